"""The files of a finished run (RUN_DIR): config.toml, model.safetensors, summary.json,
metrics.jsonl; and loading a trained model back (from model.safetensors or, for an unfinished
run, its newest checkpoint) for generation, evaluation or export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from fourfold.config import Config, ConfigError, load_config
from fourfold.files import atomic_path
from fourfold.models.llama import Llama, build_model
from fourfold.rundir import CONFIG_FILE
from fourfold.safetensors_stream import TensorSpec, write_streamed

if TYPE_CHECKING:
    from fourfold.data import Tokenizer
    from fourfold.parallel.parallelize import ParallelModel

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
    with atomic_path(path) as tmp:  # a crash mid-write never leaves a truncated file
        save_file(tensors, str(tmp), metadata={"format": "fourfold"})


def save_weights_streamed(pmodel: "ParallelModel", path: Path, tie_embeddings: bool,
                          writer_rank: int = 0) -> None:
    """Write the full model of a parallelized `pmodel` to safetensors, as save_weights does,
    streaming one tensor at a time to `writer_rank`, which alone writes (via a temporary name):
    no rank ever holds the whole model. Collective: every rank of the grid calls it. On a
    simulated grid (Grid.simulated, whose fake tensors have no bytes) the same stream
    (`writer_rank` assembles each full tensor), nothing written."""
    specs = pmodel.full_tensor_specs()
    keep = {s.name: s.name for s in specs if not (tie_embeddings and s.name == "output.weight")}
    writes = pmodel.grid.rank == writer_rank and not pmodel.grid.simulated
    write_streamed(path if writes else None, specs,
                   pmodel.stream_full_tensors(writer_rank), {"format": "fourfold"}, keep)


def read_specs(path: Path) -> list[TensorSpec]:
    """Name, dtype and shape of each tensor in a safetensors file (its header only)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return [TensorSpec(name, _TORCH_DTYPES[f.get_slice(name).get_dtype()],
                               tuple(f.get_slice(name).get_shape())) for name in f.keys()]
    except (SafetensorError, OSError) as e:
        raise RunDirError(f"{path}: cannot read model weights ({e})") from None


def _check_fits(model: Llama, specs: list[TensorSpec], path: Path) -> None:
    shapes = {s.name: s.shape for s in specs
              if not (model.cfg.tie_embeddings and s.name == "output.weight")}
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()
                if not (model.cfg.tie_embeddings and n == "output.weight")}
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise RunDirError(f"{path}: weights do not fit the model in config.toml "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise RunDirError(f"{path}: {name} has shape {shapes[name]}, the model in "
                              f"config.toml needs {shape}")


def load_weights(model: Llama, path: Path) -> None:
    """Load a model.safetensors written by save_weights into `model` (all names must match);
    a model built on the meta device takes the file's tensors as its parameters."""
    _check_fits(model, read_specs(path), path)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise RunDirError(f"{path}: cannot read model weights ({e})") from None
    if model.cfg.tie_embeddings:
        state.pop("output.weight", None)
    on_meta = model.embed.weight.is_meta
    model.load_state_dict(state, strict=False, assign=on_meta)
    if on_meta and model.cfg.tie_embeddings:
        model.output.weight = model.embed.weight


def _run_config(run_dir: str | Path) -> Config:
    run = Path(run_dir)
    if not run.is_dir():
        raise RunDirError(f"run directory {str(run_dir)!r} does not exist")
    if not (run / CONFIG_FILE).is_file():
        raise RunDirError(f"run directory {str(run_dir)!r} has no {CONFIG_FILE}; is it a "
                          "fourfold RUN_DIR?")
    try:
        return load_config(run / CONFIG_FILE, saved=True)
    except ConfigError as e:
        raise RunDirError(f"{run / CONFIG_FILE}: {e}") from None


def run_config(run_dir: str | Path) -> Config:
    """The config.toml of a RUN_DIR (a RunDirError, one line, if it is not one)."""
    return _run_config(run_dir)


def load_trained(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[Llama, Config]:
    """The trained model (in eval mode) and the config of a run: its model.safetensors, or,
    for a run still training or one that died, the weights of its newest complete checkpoint."""
    run = Path(run_dir)
    cfg = _run_config(run)
    if (run / WEIGHTS_FILE).is_file():
        model = build_model(cfg.model, seed=0, device="meta")  # the file fills it
        load_weights(model, run / WEIGHTS_FILE)
    else:
        from fourfold.parallel.grid import Grid
        from fourfold.train.checkpoint import CheckpointManager, load_weights_from_checkpoint

        path = CheckpointManager(run, cfg.checkpoint, Grid.single()).latest_valid()
        if path is None:
            raise RunDirError(f"run directory {str(run_dir)!r} has no {WEIGHTS_FILE} and no "
                              "complete checkpoint; train it to the end, or with "
                              "checkpoint.every > 0")
        if cfg.adapter.kind != "none":  # the checkpoint holds the adapter alone
            model = _adapter_model_from_checkpoint(path, cfg)
        else:
            model = Llama(cfg.model)
            load_weights_from_checkpoint(path, model)
    model.to(device)
    model.eval()
    return model, cfg


def _adapter_model_from_checkpoint(path: Path, cfg: Config) -> Llama:
    """The merged model of an adapter run's checkpoint: the base rebuilt as the run built it
    (model.init_from, or the seed), the adapter loaded onto it, folded in."""
    from fourfold.config import CheckpointConfig, ParallelConfig
    from fourfold.models.adapter import apply_adapter, merged_state_dict
    from fourfold.models.hf import load_hf_into
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.checkpoint import BaseReference, CheckpointManager

    grid = Grid.single()
    model = build_model(cfg.model, seed=cfg.train.seed)
    pmodel = parallelize(model, grid, ParallelConfig(gemm_tuning=False))
    if cfg.model.init_from:
        load_hf_into(pmodel, cfg.model.init_from)
    apply_adapter(pmodel, cfg.adapter, cfg.train.seed)
    manager = CheckpointManager.for_model(path.parent.parent, CheckpointConfig(), grid, pmodel,
                                          trainable_only=True)
    manager.register("base", BaseReference(cfg.model.init_from, cfg.train.seed))
    manager.load(path, restore_rng=False)
    merged = Llama(cfg.model)
    state = merged_state_dict(model.state_dict(), cfg.adapter)
    if cfg.model.tie_embeddings:
        state.pop("output.weight", None)
    merged.load_state_dict(state, strict=False)
    return merged


def trained_tensors(run_dir: str | Path
                    ) -> tuple[Config, list[TensorSpec], Iterator[tuple[TensorSpec, torch.Tensor]]]:
    """The config of a run, and its trained weights as specs plus an iterator over the tensors,
    one at a time (fourfold names; a tied output weight only as embed.weight): read tensor by
    tensor from model.safetensors, so that an export never holds the whole model. A run without
    one is loaded whole from its newest checkpoint."""
    run = Path(run_dir)
    weights = run / WEIGHTS_FILE
    if not weights.is_file():
        model, cfg = load_trained(run)  # raises the RunDirError that fits
        state = {n: t for n, t in model.state_dict().items()
                 if not (cfg.model.tie_embeddings and n == "output.weight")}
        specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
        return cfg, specs, iter(zip(specs, state.values()))
    cfg = _run_config(run)
    specs = read_specs(weights)
    _check_fits(build_model(cfg.model, seed=0, device="meta"), specs, weights)

    def tensors() -> Iterator[tuple[TensorSpec, torch.Tensor]]:
        with safe_open(str(weights), framework="pt") as f:
            for spec in specs:
                yield spec, f.get_tensor(spec.name)

    return cfg, specs, tensors()


def run_tokenizer(run_dir: str | Path, cfg: Config) -> "Tokenizer":
    """The tokenizer whose ids a run (`cfg`, its config.toml) was trained on: the copy in
    RUN_DIR/tokenizer; for a run that has none, its data directory's own (a built-in corpus's
    for its data.tokenizer), which must be the one the run recorded."""
    from fourfold.data import ByteTokenizer, load_tokenizer
    from fourfold.data.tokenizers import tokenizer_fingerprint
    from fourfold.rundir import TOKENIZER_DIR, tokenizer_mismatch

    own = Path(run_dir) / TOKENIZER_DIR
    if own.is_dir():
        tokenizer = load_tokenizer(own)
    elif cfg.data.path.startswith("builtin:") and cfg.data.tokenizer in ("auto", "byte"):
        tokenizer = ByteTokenizer()  # without building the corpus
    else:
        tokenizer = load_tokenizer(run_data_dir(cfg))
    recorded, found = cfg.data.tokenizer_fingerprint, tokenizer_fingerprint(tokenizer)
    if recorded and recorded != found:
        where = own if own.is_dir() else cfg.data.path
        raise RunDirError(tokenizer_mismatch(f"the run {str(run_dir)!r}", recorded, found,
                                             f"its tokenizer ({where})"))
    return tokenizer


def run_template_dir(run_dir: str | Path, cfg: Config) -> Path:
    """Where a run's chat template is kept (data.chat_template.TEMPLATE_FILE; none there: the
    run's data was text): RUN_DIR, which a run copies it into, or, for a run that kept no
    files of its data (from before it did), its DATA_DIR."""
    from fourfold.data.chat_template import TEMPLATE_FILE
    from fourfold.rundir import TOKENIZER_DIR

    run = Path(run_dir)
    if (run / TEMPLATE_FILE).is_file() or (run / TOKENIZER_DIR).is_dir():
        return run
    return run_data_dir(cfg)


def run_data_dir(cfg: Config) -> Path:
    """The DATA_DIR a run (`cfg`, its config.toml) was trained on (a built-in corpus is
    prepared again, for its data.tokenizer, where the cache lost it)."""
    from fourfold.data import resolve_data_path

    path, spec = cfg.data.path, cfg.data.tokenizer
    if not path.startswith("builtin:"):
        spec = "auto"  # the data's own: an older run recorded "byte" whatever its data held
    return resolve_data_path(path, spec)


_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                 "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                 "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    (run_dir / SUMMARY_FILE).write_text(json.dumps(dict(summary), indent=2) + "\n")
