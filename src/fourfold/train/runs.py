"""The files of a finished run (RUN_DIR): config.toml, model.safetensors, summary.json,
metrics.jsonl; and loading a trained model back (from model.safetensors or, for an unfinished
run, its newest checkpoint) for generation, evaluation or export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fourfold.config import Config, ConfigError, load_config
from fourfold.models.llama import Llama
from fourfold.safetensors_stream import write_streamed

if TYPE_CHECKING:
    from fourfold.parallel.parallelize import ParallelModel

CONFIG_FILE = "config.toml"
WEIGHTS_FILE = "model.safetensors"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.txt"


class RunDirError(ConfigError):
    """A RUN_DIR that is missing or incomplete. A ConfigError subclass, so that the CLI reports
    it like any other user mistake: one line, exit code 2."""


def save_weights(state: Mapping[str, torch.Tensor], path: Path, tie_embeddings: bool) -> None:
    """Write a full fourfold state dict to safetensors (a tied output weight is stored once,
    as embed.weight, because safetensors refuses tensors that share memory)."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()
               if not (tie_embeddings and name == "output.weight")}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "fourfold"})
    tmp.replace(path)  # a crash mid-write never leaves a truncated model.safetensors


def save_weights_streamed(pmodel: "ParallelModel", path: Path, tie_embeddings: bool,
                          writer_rank: int = 0) -> None:
    """Write the full model of a parallelized `pmodel` to safetensors, as save_weights does,
    streaming one tensor at a time to `writer_rank`, which alone writes (via a temporary name):
    no rank ever holds the whole model. Collective: every rank of the grid calls it."""
    specs = pmodel.full_tensor_specs()
    keep = {s.name: s.name for s in specs if not (tie_embeddings and s.name == "output.weight")}
    write_streamed(path if pmodel.grid.rank == writer_rank else None, specs,
                   pmodel.stream_full_tensors(writer_rank), {"format": "fourfold"}, keep)


def load_weights(model: Llama, path: Path) -> None:
    """Load a model.safetensors written by save_weights into `model` (all names must match)."""
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise RunDirError(f"{path}: cannot read model weights ({e})") from None
    if model.cfg.tie_embeddings:
        state.pop("output.weight", None)
    expected = {n for n in model.state_dict() if not (model.cfg.tie_embeddings
                                                     and n == "output.weight")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise RunDirError(f"{path}: weights do not fit the model in config.toml "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, tensor in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(tensor.shape):
            raise RunDirError(f"{path}: {name} has shape {tuple(state[name].shape)}, the model in "
                              f"config.toml needs {tuple(tensor.shape)}")
    model.load_state_dict(state, strict=False)


def load_trained(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[Llama, Config]:
    """The trained model (in eval mode) and the config of a run: its model.safetensors, or,
    for a run still training or one that died, the weights of its newest complete checkpoint."""
    run = Path(run_dir)
    if not run.is_dir():
        raise RunDirError(f"run directory {str(run_dir)!r} does not exist")
    if not (run / CONFIG_FILE).is_file():
        raise RunDirError(f"run directory {str(run_dir)!r} has no {CONFIG_FILE}; is it a "
                          "fourfold RUN_DIR?")
    try:
        cfg = load_config(run / CONFIG_FILE)
    except ConfigError as e:
        raise RunDirError(f"{run / CONFIG_FILE}: {e}") from None
    model = Llama(cfg.model)
    if (run / WEIGHTS_FILE).is_file():
        load_weights(model, run / WEIGHTS_FILE)
    else:
        from fourfold.parallel.grid import Grid
        from fourfold.train.checkpoint import CheckpointManager, load_weights_from_checkpoint

        path = CheckpointManager(run, cfg.checkpoint, Grid.single()).latest_valid()
        if path is None:
            raise RunDirError(f"run directory {str(run_dir)!r} has no {WEIGHTS_FILE} and no "
                              "complete checkpoint; train it to the end, or with "
                              "checkpoint.every > 0")
        load_weights_from_checkpoint(path, model)
    model.to(device)
    model.eval()
    return model, cfg


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    (run_dir / SUMMARY_FILE).write_text(json.dumps(dict(summary), indent=2) + "\n")


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        raise RunDirError(f"run directory {str(run_dir)!r} has no {SUMMARY_FILE}")
    return json.loads(path.read_text())
