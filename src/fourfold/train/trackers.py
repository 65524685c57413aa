"""Experiment trackers: TensorBoard, Weights & Biases and MLflow receive the scalars that
metrics.jsonl gets, and the run's config once.

`logging.trackers` picks any of them; a tracker's package is imported only when it is picked,
and a picked tracker whose package is missing stops the run before it starts with one line
that says what to install (`require_trackers`, which every rank calls, so that no rank waits
for one that stopped). Only the main rank opens trackers (`open_trackers`).

A tracker that cannot start or fails later (a login, a server, a disk) is dropped with a
warning: the run, and metrics.jsonl, go on. A resumed run goes on in the same W&B and MLflow
runs: their run ids are kept in RUN_DIR/trackers.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Protocol

from fourfold.config import Config, ConfigError

TRACKER_IDS_FILE = "trackers.json"
# A tracker's name -> (the module it imports, the package that provides it).
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit on the parameters of one log_batch


class Tracker(Protocol):
    """One experiment tracker: scalars by step, then close."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def chosen_trackers(cfg: Config) -> list[str]:
    """logging.trackers, with train.tensorboard = true adding "tensorboard"; each once."""
    names = list(dict.fromkeys(cfg.logging.trackers))
    if cfg.train.tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    return names


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def require_trackers(cfg: Config) -> None:
    """Raise ConfigError, one line, for a chosen tracker whose package is not installed.
    Imports nothing (find_spec), so it is cheap on every rank."""
    for name in chosen_trackers(cfg):
        module, package = PACKAGES[name]
        if not _installed(module):
            raise ConfigError(f"logging.trackers includes {name!r} but the {package} package "
                              f"is not installed; pip install {package} (or drop {name!r})")


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record that a tracker plots: every int or float but the
    step (booleans and text stay in metrics.jsonl)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(cfg: Config) -> dict[str, Any]:
    """The config as {"section.key": value}, the shape the trackers' parameter views take."""
    return {f"{section}.{key}": value for section, keys in cfg.to_dict().items()
            for key, value in keys.items()}


class TensorBoardTracker:
    """Scalars into RUN_DIR/tensorboard (torch's SummaryWriter); the config as a text entry."""

    def __init__(self, directory: Path, cfg: Config) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(str(directory))
        self._writer.add_text("config", "```toml\n" + cfg.to_toml() + "\n```", 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run (the wandb package's own settings apply: WANDB_MODE=offline
    writes it under RUN_DIR/wandb for a later `wandb sync`)."""

    def __init__(self, run_dir: Path, cfg: Config, name: str, run_id: str | None) -> None:
        import wandb

        self._run: Any = wandb.init(project=cfg.logging.project, name=name, dir=str(run_dir),
                                    config=flat_config(cfg), id=run_id, resume="allow")
        self.run_id: str = self._run.id

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


def default_mlflow_uri(run_dir: Path) -> str:
    """MLflow's own default store (an SQLite database), in the run directory."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class MlflowTracker:
    """An MLflow run in experiment logging.project, through an MlflowClient (no process-wide
    active run): the config as parameters and as config.toml, the scalars as metrics."""

    def __init__(self, run_dir: Path, cfg: Config, name: str, run_id: str | None) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        uri = cfg.logging.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        # the default store's artifacts beside it (MLflow would put them under ./mlruns)
        artifacts = None if uri else (run_dir / "mlartifacts").resolve().as_uri()
        self._metric = Metric
        self._client: Any = MlflowClient(tracking_uri=uri or default_mlflow_uri(run_dir))
        if run_id is None:
            experiment = self._client.get_experiment_by_name(cfg.logging.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self._client.create_experiment(
                                 cfg.logging.project, artifact_location=artifacts))
            run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
            params = [Param(k, str(v)) for k, v in flat_config(cfg).items()]
            for i in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
                self._client.log_batch(run_id, params=params[i:i + MLFLOW_PARAMS_PER_CALL])
            self._client.log_text(run_id, cfg.to_toml(), "config.toml")
        self.run_id: str = run_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            self._metric(key, value, now, step) for key, value in scalars.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def open_trackers(cfg: Config, run_dir: Path, resuming: bool) -> list[Tracker]:
    """The chosen trackers, opened (main rank only). `resuming`: go on in the W&B and MLflow
    runs named in RUN_DIR/trackers.json; otherwise start new ones and name them there."""
    names = chosen_trackers(cfg)
    if not names:
        return []
    require_trackers(cfg)
    ids_path = run_dir / TRACKER_IDS_FILE
    ids: dict[str, str] = {}
    if resuming and ids_path.exists():
        ids = json.loads(ids_path.read_text())
    name = cfg.logging.run_name or run_dir.resolve().name
    trackers: list[Tracker] = []
    for tracker in names:
        try:
            if tracker == "tensorboard":
                trackers.append(TensorBoardTracker(run_dir / "tensorboard", cfg))
            elif tracker == "wandb":
                run = WandbTracker(run_dir, cfg, name, ids.get("wandb"))
                ids["wandb"] = run.run_id
                trackers.append(run)
            else:
                mlflow_run = MlflowTracker(run_dir, cfg, name, ids.get("mlflow"))
                ids["mlflow"] = mlflow_run.run_id
                trackers.append(mlflow_run)
        except Exception as e:  # a login or a server: the other ranks are waiting to train
            warnings.warn(f"logging.trackers: {tracker} could not start ({type(e).__name__}: "
                          f"{e}); the run goes on without it", stacklevel=2)
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return trackers


__all__ = ["MlflowTracker", "TensorBoardTracker", "Tracker", "WandbTracker", "chosen_trackers",
           "open_trackers", "require_trackers", "scalars_of"]
