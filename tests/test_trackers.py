"""Experiment trackers ([logging] trackers): each gets the scalars metrics.jsonl gets and the
config, is imported only when chosen, and a missing package is one error line. The adapters
are checked against stand-in modules that record every call (no network, no packages); the
real packages, where installed, in their offline modes."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from fourfold import cli
from fourfold.config import ConfigError, load_config
from fourfold.train import train
from fourfold.train.metrics import MetricsLog, read_metrics
from fourfold.train.trackers import (TRACKER_IDS_FILE, default_mlflow_uri, open_trackers,
                                     require_trackers)

from test_train import small_config

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


class Calls:
    """What the stand-in trackers were asked to do, in order."""

    def __init__(self) -> None:
        self.wandb_init: list[dict[str, Any]] = []
        self.wandb_log: list[tuple[dict[str, float], int]] = []
        self.wandb_finished = 0
        self.mlflow: list[tuple[str, Any]] = []
        self.tb_scalars: list[tuple[str, float, int]] = []
        self.tb_text: list[str] = []
        self.tb_closed = 0


@pytest.fixture
def fake_trackers(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """wandb, mlflow and torch.utils.tensorboard replaced by recorders of their calls."""
    calls = Calls()

    class Run:
        def __init__(self, id: str | None) -> None:
            self.id = id or "wandb-run-1"

        def log(self, data: dict[str, float], step: int) -> None:
            calls.wandb_log.append((dict(data), step))

        def finish(self) -> None:
            calls.wandb_finished += 1

    def init(**kwargs: Any) -> Run:
        calls.wandb_init.append(kwargs)
        return Run(kwargs.get("id"))

    class Metric:
        def __init__(self, key: str, value: float, timestamp: int, step: int) -> None:
            self.key, self.value, self.step = key, value, step

    class Param:
        def __init__(self, key: str, value: str) -> None:
            self.key, self.value = key, value

    class Client:
        def __init__(self, tracking_uri: str) -> None:
            calls.mlflow.append(("uri", tracking_uri))

        def get_experiment_by_name(self, name: str) -> None:
            return None

        def create_experiment(self, name: str, artifact_location: str | None) -> str:
            calls.mlflow.append(("experiment", name))
            calls.mlflow.append(("artifacts", artifact_location))
            return "7"

        def create_run(self, experiment_id: str, run_name: str) -> Any:
            calls.mlflow.append(("run", (experiment_id, run_name)))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="mlflow-run-1"))

        def log_batch(self, run_id: str, metrics: Any = (), params: Any = ()) -> None:
            if params:
                calls.mlflow.append(("params", {p.key: p.value for p in params}))
            if metrics:
                calls.mlflow.append(("metrics", {m.key: (m.value, m.step) for m in metrics}))

        def log_text(self, run_id: str, text: str, path: str) -> None:
            calls.mlflow.append(("text", (path, text)))

        def set_terminated(self, run_id: str) -> None:
            calls.mlflow.append(("terminated", run_id))

    class SummaryWriter:
        def __init__(self, log_dir: str) -> None:
            self.log_dir = log_dir

        def add_scalar(self, key: str, value: float, step: int) -> None:
            calls.tb_scalars.append((key, value, step))

        def add_text(self, key: str, text: str, step: int) -> None:
            calls.tb_text.append(text)

        def close(self) -> None:
            calls.tb_closed += 1

    monkeypatch.setitem(sys.modules, "wandb", _module("wandb", init=init))
    monkeypatch.setitem(sys.modules, "mlflow", _module("mlflow"))
    monkeypatch.setitem(sys.modules, "mlflow.entities",
                        _module("mlflow.entities", Metric=Metric, Param=Param))
    monkeypatch.setitem(sys.modules, "mlflow.tracking",
                        _module("mlflow.tracking", MlflowClient=Client))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        _module("torch.utils.tensorboard", SummaryWriter=SummaryWriter))
    return calls


def _scalar_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r]


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k != "step"
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.mark.slow
def test_every_tracker_gets_the_scalars_of_metrics_jsonl_and_the_config(
        tmp_path: Path, fake_trackers: Calls) -> None:
    cfg = small_config("train.steps=4", "train.log_every=2", "train.eval_every=2",
                       "train.eval_batches=1", "logging.trackers=tensorboard,wandb,mlflow",
                       "logging.project=proj", "logging.run_name=first")
    train(cfg, tmp_path, progress=False)
    records = _scalar_records(tmp_path)
    assert [r["step"] for r in records] == [0, 2, 2, 4, 4]  # validation at 0, 2, 4
    expected = [(_numbers(r), r["step"]) for r in records]
    assert fake_trackers.wandb_log == expected
    mlflow_metrics = [v for k, v in fake_trackers.mlflow if k == "metrics"]
    assert mlflow_metrics == [{k: (v, step) for k, v in numbers.items()}
                              for numbers, step in expected]
    assert fake_trackers.tb_scalars == [(k, v, step) for numbers, step in expected
                                        for k, v in numbers.items()]
    assert any("loss_mean" in numbers for numbers, _ in expected)
    # the config: wandb's run config, mlflow's parameters and file, tensorboard's text
    init = fake_trackers.wandb_init[0]
    assert init["project"] == "proj" and init["name"] == "first" and init["dir"] == str(tmp_path)
    assert init["config"]["train.steps"] == 4 and init["config"]["model.preset"] == "debug"
    params: dict[str, str] = {}
    for kind, value in fake_trackers.mlflow:
        if kind == "params":
            params.update(value)
    assert params["train.log_every"] == "2" and params["logging.project"] == "proj"
    assert ("experiment", "proj") in fake_trackers.mlflow
    assert ("run", ("7", "first")) in fake_trackers.mlflow
    assert ("uri", default_mlflow_uri(tmp_path)) in fake_trackers.mlflow
    assert ("artifacts", (tmp_path / "mlartifacts").resolve().as_uri()) in fake_trackers.mlflow
    text = dict(v for k, v in fake_trackers.mlflow if k == "text")["config.toml"]
    assert text == (tmp_path / "config.toml").read_text()
    assert "steps = 4" in fake_trackers.tb_text[0]
    # closed once at the end; the run ids kept for a resume
    assert fake_trackers.wandb_finished == 1 and fake_trackers.tb_closed == 1
    assert fake_trackers.mlflow[-1] == ("terminated", "mlflow-run-1")
    assert json.loads((tmp_path / TRACKER_IDS_FILE).read_text()) == {
        "wandb": "wandb-run-1", "mlflow": "mlflow-run-1"}


def test_a_resumed_run_goes_on_in_the_same_tracker_runs(
        tmp_path: Path, fake_trackers: Calls) -> None:
    cfg = load_config(None, ["logging.trackers=wandb,mlflow"])
    (tmp_path / TRACKER_IDS_FILE).write_text(json.dumps({"wandb": "w9", "mlflow": "m9"}))
    trackers = open_trackers(cfg, tmp_path, resuming=True)
    assert fake_trackers.wandb_init[0]["id"] == "w9"
    assert fake_trackers.wandb_init[0]["resume"] == "allow"
    assert not [k for k, _ in fake_trackers.mlflow if k in ("run", "params", "experiment")]
    trackers[1].log({"loss": 1.5}, 12)
    assert fake_trackers.mlflow[-1] == ("metrics", {"loss": (1.5, 12)})
    fresh = open_trackers(cfg, tmp_path, resuming=False)  # a new run: new ids
    assert fake_trackers.wandb_init[1]["id"] is None
    ids = [t.run_id for t in fresh]  # type: ignore[attr-defined]
    assert ids == ["wandb-run-1", "mlflow-run-1"]


def test_no_tracker_imports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("wandb", "mlflow", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it would raise
    cfg = load_config(None, [])
    require_trackers(cfg)
    assert open_trackers(cfg, tmp_path, resuming=False) == []
    assert not (tmp_path / TRACKER_IDS_FILE).exists()


def test_an_unknown_tracker_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"logging.trackers: 'neptune' is not a tracker; "
                                          r"choose from tensorboard, wandb, mlflow"):
        load_config(None, ["logging.trackers=wandb,neptune"])


@pytest.mark.parametrize("tracker,package", [("wandb", "wandb"), ("mlflow", "mlflow"),
                                             ("tensorboard", "tensorboard")])
def test_a_missing_package_is_one_error_line_before_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tracker: str, package: str) -> None:
    module = {"tensorboard": "torch.utils.tensorboard"}.get(tracker, tracker)
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    code = cli.main(["train", "--set", "model.preset=debug", "--set",
                     f"logging.trackers={tracker}", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"error: logging.trackers includes {tracker!r} but the {package} package is "
                   f"not installed; pip install {package} (or drop {tracker!r})"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_tensorboard_still_means_the_tensorboard_tracker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="includes 'tensorboard'"):
        require_trackers(load_config(None, ["train.tensorboard=true"]))


@pytest.mark.slow
def test_the_real_trackers_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb in offline mode, MLflow's local SQLite store and TensorBoard's event files: what
    each wrote reads back as metrics.jsonl's numbers."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = small_config("train.steps=2", "train.log_every=1",
                       "logging.trackers=tensorboard,wandb,mlflow")
    train(cfg, tmp_path, progress=False)
    assert list(cwd.iterdir()) == []  # every tracker wrote into the run directory
    records = [r for r in _scalar_records(tmp_path) if "loss" in r]
    ids = json.loads((tmp_path / TRACKER_IDS_FILE).read_text())

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=default_mlflow_uri(tmp_path))
    history = client.get_metric_history(ids["mlflow"], "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in records]
    assert client.get_run(ids["mlflow"]).data.params["train.steps"] == "2"
    assert (tmp_path / "mlartifacts").is_dir()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [e.step for e in scalars] == [r["step"] for r in records]
    assert [e.value for e in scalars] == pytest.approx([r["loss"] for r in records])  # float32

    offline = list((tmp_path / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_log_goes_on(
        tmp_path: Path) -> None:
    seen: list[tuple[dict[str, float], int]] = []

    class Broken:
        def log(self, scalars: dict[str, float], step: int) -> None:
            raise OSError("connection reset")

        def close(self) -> None:
            pass

    class Recorder(Broken):
        def log(self, scalars: dict[str, float], step: int) -> None:
            seen.append((scalars, step))

    log = MetricsLog(tmp_path / "metrics.jsonl", [Broken(), Recorder()])
    with pytest.warns(UserWarning, match=r"Broken failed \(OSError: connection reset\); the run "
                                         "goes on without it"):
        log.write({"step": 1, "loss": 2.0})
    log.write({"step": 2, "loss": 1.5, "skipped": True, "skip_reason": "spike"})
    log.write({"event": "rollback", "step": 2, "to_step": 1})
    log.close()
    assert seen == [({"loss": 2.0}, 1), ({"loss": 1.5}, 2)]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_a_tracker_that_cannot_start_is_left_out_with_a_warning(
        tmp_path: Path, fake_trackers: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    def init(**kwargs: Any) -> None:
        raise RuntimeError("api key needed")

    monkeypatch.setattr(sys.modules["wandb"], "init", init)
    cfg = load_config(None, ["logging.trackers=wandb,mlflow"])
    with pytest.warns(UserWarning, match=r"logging.trackers: wandb could not start "
                                         r"\(RuntimeError: api key needed\)"):
        trackers = open_trackers(cfg, tmp_path, resuming=False)
    assert [type(t).__name__ for t in trackers] == ["MlflowTracker"]
    assert json.loads((tmp_path / TRACKER_IDS_FILE).read_text()) == {"mlflow": "mlflow-run-1"}
