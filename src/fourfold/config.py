"""Typed run configuration: TOML files, `--set section.key=value` overrides, validation.

A config has the sections [model], [data], [train], [parallel], [checkpoint], [adapter],
[logging]. Every key has a type and a default; an unknown key, a wrong type or an impossible
value raises ConfigError with one line that names the key and what is allowed. The CLI turns
ConfigError into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from fourfold.errors import ConfigError, ConfigNotice
from fourfold.files import atomic_write_text, tomllib
from fourfold.intmath import divisors
from fourfold.methods import MethodOptions, MethodSpec, method_names, method_spec


def cache_root() -> Path:
    """Where fourfold keeps what it measures or prepares once (the built-in corpus, CPU probes,
    GEMM choices): $FOURFOLD_CACHE, else ~/.cache/fourfold."""
    env = os.environ.get("FOURFOLD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fourfold"


def write_cache_json(path: Path, obj: Any) -> None:
    """Write a cache file under cache_root() atomically (ranks on one node may race here). An
    unwritable cache is ignored: it only costs measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(obj, indent=1))
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Sections


@dataclass
class ModelConfig:
    preset: str = "small"  # a named size (PRESETS; custom: the keys below)
    n_layers: int = 4  # transformer blocks
    dim: int = 256  # hidden size
    n_heads: int = 8  # attention heads
    n_kv_heads: int = 4  # key/value heads (grouped-query attention)
    ffn_dim: int = 768  # SwiGLU hidden size
    vocab_size: int = 512  # tokens in the vocabulary
    max_seq_len: int = 512  # longest sequence the model takes
    rope_theta: float = 10000.0  # RoPE base frequency
    # how RoPE's frequencies are stretched for a longer context (HF's rope_type): none |
    # linear (every frequency / rope_factor) | llama3 (low frequencies / rope_factor, high ones
    # kept, a smooth blend between; Llama 3.1-3.3)
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # linear, llama3
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_seq_len: int = 8192  # llama3: the context the model was pretrained for
    tie_embeddings: bool = False  # output layer shares the embedding's weight
    norm_eps: float = 1e-5  # RMSNorm epsilon
    bias: bool = False  # biases on every attention and MLP projection
    init_std: float = 0.02  # std of the initial weights
    init_from: str = ""  # a local Hugging Face checkpoint directory to start from

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class DataConfig:
    path: str = "builtin:stdlib"  # a DATA_DIR made by `fourfold prepare`, or the built-in corpus
    # auto (a prepared directory's own; byte for a built-in corpus) | byte | bpe:VOCAB_SIZE |
    # PATH/tokenizer.json: a built-in corpus is prepared with it; a prepared directory must
    # have been made with it
    tokenizer: str = "auto"
    # auto | documents | none: "documents" packs whole documents into each sequence, attention
    # never crossing from one to another and positions restarting at each; "none" draws
    # windows at random offsets, across documents; "auto": documents for chat and instruction
    # data, none for text
    packing: str = "auto"
    # what a run records of the tokenizer it trained with ("byte" or sha256:... of its
    # tokenizer.json); when set, the data must have been made with that very tokenizer
    tokenizer_fingerprint: str = ""


@dataclass
class TrainConfig:
    steps: int = 400  # optimizer steps
    batch_size: int = 16  # sequences per optimizer step, whole job
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at lr x this
    warmup_steps: int = 30  # linear warmup to lr
    weight_decay: Union[float, str] = "auto"  # "auto": the method's own (fourfold.methods)
    beta1: float = 0.9  # first-moment decay (AdamW, BlockLLM, GaLore)
    beta2: float = 0.95  # second-moment decay (AdamW, AdaLomo, BlockLLM, GaLore)
    grad_clip: float = 1.0  # gradient-norm clip (0: none)
    grad_accum: int = 1  # micro-batches per step
    dtype: str = "float32"  # float32 | bfloat16 (autocast, float32 weights)
    seed: int = 1337  # model init, data order and noise
    compile: bool = False  # torch.compile each block
    activation_checkpointing: bool = False  # recompute each block in backward
    eval_every: int = 100  # steps between validations (0: none)
    eval_batches: int = 4  # batches per validation
    log_every: int = 10  # steps between log lines
    sample_every: int = 0  # 0: only at the end
    sample_tokens: int = 64  # tokens generated per sample (0: no samples)
    loss: str = "cross_entropy"  # cross_entropy | goldfish
    goldfish_k: int = 4  # goldfish: drop one token in k from the loss
    goldfish_h: int = 13  # goldfish: tokens of context hashed to choose it
    device: str = "auto"  # auto | cpu | cuda
    tensorboard: bool = False  # true: the same as "tensorboard" in logging.trackers
    nan_policy: str = "stop"  # stop | skip | rollback
    spike_threshold: float = 0.0  # 0 disables; else a loss above threshold x running mean is a spike
    max_restarts: int = 0  # times the launcher restarts a failed job
    optimizer: str = "adamw"  # the training method: adamw, lomo, adalomo, mezo, es, blockllm, galore
    memory_report: bool = False  # peak bytes per rank by category into summary.json
    # [train.method]: train.optimizer's own options (fourfold.methods); None: its defaults
    method: Optional[MethodOptions] = None

    def options(self) -> MethodOptions:
        """train.optimizer's options: `method` where it holds that method's, else its
        defaults (as after dataclasses.replace(train, optimizer=another))."""
        spec = method_spec(self.optimizer)
        if isinstance(self.method, spec.options):
            return self.method
        return spec.options()

    def effective_weight_decay(self) -> float:
        """train.weight_decay, with "auto" resolved for train.optimizer (its method's)."""
        if isinstance(self.weight_decay, str):
            return method_spec(self.optimizer).weight_decay
        return self.weight_decay


@dataclass
class ParallelConfig:
    x: int = 1  # grid axis x (docs/parallelism.md)
    y: int = 1  # grid axis y
    z: int = 1  # grid axis z (weights and batch split over it)
    data: Union[int, str] = "auto"  # "auto" fills the world size
    auto: bool = False  # ask the planner for the grid
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0  # collective timeout, seconds
    overlap_input_grad: bool = True  # dI all-reduce under the dW GEMM
    overlap_weight_grad: bool = True  # dW reduce-scatter under earlier layers' backward
    prefetch_weights: bool = True  # next layer's z all-gather one layer ahead
    overlap_data_grad: bool = True  # bucketed data-parallel all-reduce during backward
    bucket_mb: float = 25.0  # data-parallel gradient buckets (parallel/data_parallel.py)
    gemm_tuning: bool = False  # time the equivalent matmuls per GEMM shape once, keep the fastest
    reduce_dtype: str = "float32"  # float32 | bfloat16: dW reduce-scatter and data all-reduce
    overlap_forward: bool = False  # forward GEMMs in two token halves, all-reduce under GEMM
    # auto | blocks | whole: the output layer and the loss a block of the vocabulary at a time,
    # logits made again in backward ("auto": blocks for lomo, adalomo, mezo, es, blockllm)
    output_loss: str = "auto"
    machine: str = "cpu"  # planner machine preset or MACHINE.toml, for parallel.auto
    # auto | always: "always" runs a one-process job through the whole engine as a one-rank
    # grid (a one-rank process group, fourfold's parallel layers and collectives, the
    # data-parallel buckets, the sharded checkpoint), to check that code on one device
    engine: str = "auto"

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


@dataclass
class CheckpointConfig:
    every: int = 0  # 0 disables periodic checkpoints
    keep: int = 3  # checkpoints kept (older are deleted)
    # TOML key `async`: write checkpoints in the background: true, false or "auto" (true on
    # GPUs; false on CPU ranks, where the snapshot would share the training's memory and cores)
    async_save: Union[bool, str] = "auto"
    resume: bool = True  # resume automatically when RUN_DIR holds a checkpoint

    def is_async(self, on_host: bool) -> bool:
        """Whether checkpoints are written in the background for ranks that compute on the
        host (`on_host`, a CPU run) or on a GPU. "auto": on a GPU the snapshot goes to host
        memory beside the device's and the writer thread takes no GPU time, so the step goes
        on at full speed; on a CPU rank the snapshot is a second copy of the weights and AdamW
        states in the memory the training uses (0.375x the float32 weights of the model on each
        of 8 ranks, alive through the next step) and the writer competes for the training's
        cores, so a CPU rank writes synchronously unless told otherwise."""
        if isinstance(self.async_save, bool):
            return self.async_save
        return not on_host


ADAPTER_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "output")


@dataclass
class AdapterConfig:
    kind: str = "none"  # none | lora | norm
    r: int = 8  # lora: rank
    alpha: float = 16.0  # lora: scale alpha / r
    dropout: float = 0.0  # lora: dropout on the adapter's input
    # lora: the layers adapted (q, k, v, o, gate, up, down, output)
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up",
                                                        "down"])
    train_norms: bool = False  # lora: the RMSNorm gains train too
    train_output: bool = False  # norm: the output layer trains too


TRACKERS = ("tensorboard", "wandb", "mlflow")  # logging.trackers: train/trackers.py


@dataclass
class LoggingConfig:
    # experiment trackers that receive every scalar of metrics.jsonl and the config: any of
    # tensorboard (into RUN_DIR/tensorboard), wandb, mlflow; each needs its package installed
    trackers: list[str] = field(default_factory=list)
    project: str = "fourfold"  # wandb: the project; mlflow: the experiment
    run_name: str = ""  # the run's name in the trackers; "": the run directory's name
    # mlflow: the tracking URI; "": $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db
    mlflow_uri: str = ""


# TOML key -> field name where they differ (`async` is a Python keyword).
_KEY_ALIASES = {("checkpoint", "async"): "async_save"}
# fields that are a table of their own ([train.method]) rather than a key of the section
_SUBTABLES = {("train", "method")}
_FIELD_TO_KEY = {(s, f): k for (s, k), f in _KEY_ALIASES.items()}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section's keys; [train.method] as the dict under train's "method" key."""
        out: dict[str, dict[str, Any]] = {}
        for sec in fields(self):
            section = getattr(self, sec.name)
            out[sec.name] = {
                _FIELD_TO_KEY.get((sec.name, f.name), f.name): getattr(section, f.name)
                for f in fields(section) if (sec.name, f.name) not in _SUBTABLES
            }
        out["train"]["method"] = dataclasses.asdict(self.train.options())
        return out

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "adapter": AdapterConfig,
    "logging": LoggingConfig,
}

# --------------------------------------------------------------------------------------------
# Model presets. Shapes of the big ones follow Llama 3 (8b, 70b, 405b); they are for the planner.

PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(n_layers=2, dim=192, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512,
                  max_seq_len=256),
    # the built-in default: trains in a few minutes on a laptop CPU with the byte tokenizer
    "small": dict(n_layers=4, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=512,
                  max_seq_len=512),
    "15m": dict(n_layers=6, dim=288, n_heads=6, n_kv_heads=6, ffn_dim=768, vocab_size=8192,
                max_seq_len=512),
    "125m": dict(n_layers=12, dim=768, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000,
                 max_seq_len=2048),
    "350m": dict(n_layers=24, dim=1024, n_heads=16, n_kv_heads=16, ffn_dim=2816,
                 vocab_size=32000, max_seq_len=2048),
    "1b": dict(n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
               max_seq_len=4096, rope_theta=500000.0, tie_embeddings=True),
    "8b": dict(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "70b": dict(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "405b": dict(n_layers=126, dim=16384, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                 vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
}

CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("model", "preset"): tuple(PRESETS) + ("custom",),
    ("model", "rope_scaling"): ("none", "linear", "llama3"),
    ("data", "packing"): ("auto", "documents", "none"),
    ("train", "dtype"): ("float32", "bfloat16"),
    ("train", "loss"): ("cross_entropy", "goldfish"),
    ("train", "device"): ("auto", "cpu", "cuda"),
    ("train", "nan_policy"): ("stop", "skip", "rollback"),
    ("parallel", "backend"): ("auto", "gloo", "nccl"),
    ("parallel", "reduce_dtype"): ("float32", "bfloat16"),
    ("parallel", "output_loss"): ("auto", "blocks", "whole"),
    ("parallel", "engine"): ("auto", "always"),
    ("adapter", "kind"): ("none", "lora", "norm"),
}


def model_config(preset: str, **overrides: Any) -> ModelConfig:
    """A ModelConfig from a preset name with optional field overrides."""
    if preset not in PRESETS:
        raise ConfigError(f"model.preset = {preset!r}: unknown preset; choose one of "
                          f"{', '.join(PRESETS)}")
    return ModelConfig(preset=preset, **{**PRESETS[preset], **overrides})


# --------------------------------------------------------------------------------------------
# Loading


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _expected_type(cls: type, name: str) -> Any:
    return get_type_hints(cls)[name]


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    """Check `value` against the field type; strings from --set are parsed first."""
    where = f"{section}.{key}"
    if get_origin(typ) is Union:  # int | str, as in parallel.data
        for option in get_args(typ):
            try:
                return _coerce(section, key, value, option)
            except ConfigError:
                continue
        names = " or ".join(t.__name__ for t in get_args(typ))
        raise ConfigError(f"{where} = {value!r}: expected {names}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} = {value!r}: expected true or false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where} = {value!r}: expected an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} = {value!r}: expected a number")
    if get_origin(typ) is list:  # a TOML list, or "a,b,c" from --set
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{where} = {value!r}: expected a list")
        return [_coerce(section, key, v.strip() if isinstance(v, str) else v, get_args(typ)[0])
                for v in items if not (isinstance(v, str) and not v.strip())]
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} = {value!r}: expected a string")
    raise TypeError(f"unsupported config type {typ} for {where}")


def _parse_override(item: str) -> tuple[str, str, str]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    path, value = item.split("=", 1)
    if "." not in path:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.steps=200")
    section, key = path.strip().split(".", 1)
    return section, key, value.strip()


def _flat_keys(section: str) -> list[str]:
    """The field names of a section's own keys (not its sub-tables)."""
    return [f.name for f in fields(SECTIONS[section]) if (section, f.name) not in _SUBTABLES]


def _check_key(section: str, key: str) -> str:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section [{section}]{_suggest(section, list(SECTIONS))}; "
                          f"sections are {', '.join(SECTIONS)}")
    name = _KEY_ALIASES.get((section, key), key)
    names = _flat_keys(section)
    if name not in names and not (section == "train" and _renamed_owners(name)):
        keys = [_FIELD_TO_KEY.get((section, n), n) for n in names]
        raise ConfigError(f"unknown key {section}.{key}{_suggest(key, keys)}; "
                          f"[{section}] takes {', '.join(keys)}")
    return name


def _renamed_owners(key: str) -> list[MethodSpec]:
    """The methods whose option was train.`key` before [train.method]."""
    return [spec for spec in map(method_spec, method_names()) if key in spec.renamed]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                saved: bool = False) -> Config:
    """Build a validated Config from an optional TOML file and `section.key=value` overrides
    (train.method.KEY=value for an option of train.optimizer's method).

    Precedence: defaults < preset (model.preset) < file < overrides. `saved` (and `path` a
    run directory): the file is a run's own config.toml, which an older version wrote with
    every method's options as [train] keys: those of other methods are dropped (they were
    that version's defaults, not choices) and its own method's read without a notice.
    """
    raw: dict[str, dict[str, Any]] = {}
    method_raw: dict[str, Any] = {}  # [train.method]
    if path is not None:
        p = Path(path)
        if p.is_dir() and (p / "config.toml").exists():
            p, saved = p / "config.toml", True  # a run directory's own config
        if not p.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{p}: top-level key {section!r} must be a [section]")
            for key, value in table.items():
                if (section, key) in _SUBTABLES:
                    if not isinstance(value, dict):
                        raise ConfigError(f"{p}: {section}.{key} must be a [{section}.{key}] "
                                          "table (train.optimizer's options)")
                    method_raw.update(value)
                    continue
                name = _check_key(section, key)
                raw.setdefault(section, {})[name] = value
    for item in overrides or []:
        section, key, value = _parse_override(item)
        if section == "train" and key.startswith("method."):
            method_raw[key[len("method."):]] = value  # a string; coerced below
            continue
        name = _check_key(section, key)
        raw.setdefault(section, {})[name] = value  # a string; coerced below

    cfg = Config()
    # The preset first, so that explicit model keys win over it.
    model_raw = raw.get("model", {})
    preset = _coerce("model", "preset", model_raw.get("preset", cfg.model.preset), str)
    if preset != "custom":
        if preset not in PRESETS:
            raise ConfigError(f"model.preset = {preset!r}: unknown preset"
                              f"{_suggest(preset, list(PRESETS))}; choose one of "
                              f"{', '.join(CHOICES[('model', 'preset')])}")
        cfg.model = model_config(preset)
    renamed = {k: raw["train"].pop(k) for k in list(raw.get("train", {}))
               if k not in _flat_keys("train")}
    for section, table in raw.items():
        cls = SECTIONS[section]
        obj = getattr(cfg, section)
        for name, value in table.items():
            key = _FIELD_TO_KEY.get((section, name), name)
            setattr(obj, name, _coerce(section, key, value, _expected_type(cls, name)))
    cfg.train.method = _method_options(cfg.train.optimizer, method_raw, renamed, saved)
    validate(cfg)
    return cfg


def _method_options(optimizer: str, given: dict[str, Any], renamed: dict[str, Any],
                    saved: bool) -> MethodOptions:
    """train.optimizer's options from [train.method] (`given`) and the old [train] keys
    (`renamed`: train.OLD -> value), coerced to their types."""
    spec = method_spec(optimizer)
    hints = get_type_hints(spec.options)
    values: dict[str, Any] = {}
    for old, value in renamed.items():
        owners = _renamed_owners(old)
        if spec in owners:
            new = spec.renamed[old]
            if new in given:
                raise ConfigError(f"train.{old} and train.method.{new} are both set; remove "
                                  f"train.{old}")
            if not saved:
                warnings.warn(f"train.{old} is deprecated: write train.method.{new} (the "
                              "[train.method] section)", ConfigNotice, stacklevel=3)
            values[new] = _coerce("train", old, value, hints[new])
            continue
        owner = owners[0]
        option = owner.renamed[old]
        coerced = _coerce("train", old, value, get_type_hints(owner.options)[option])
        if saved:
            continue
        if coerced != getattr(owner.options(), option):
            raise ConfigError(f"train.{old} = {coerced!r} applies only to train.optimizer = "
                              f"{' or '.join(repr(o.name) for o in owners)}, not "
                              f"{optimizer!r}; remove it")
        warnings.warn(f"train.{old} is deprecated: write train.method.{option} under "
                      f"train.optimizer = {owner.name!r}", ConfigNotice, stacklevel=3)
    names = spec.option_names()
    for key, value in given.items():
        if key not in names:
            owners = [o.name for o in map(method_spec, method_names())
                      if key in o.option_names()]
            if owners:
                raise ConfigError(f"train.method.{key} applies only to train.optimizer = "
                                  f"{' or '.join(map(repr, owners))}, not {optimizer!r}; "
                                  "remove it")
            takes = f"takes {', '.join(names)}" if names else "has no options"
            raise ConfigError(f"unknown key train.method.{key}{_suggest(key, names)}; "
                              f"train.optimizer = {optimizer!r} {takes}")
        values[key] = _coerce("train.method", key, value, hints[key])
    return spec.options(**values)


# --------------------------------------------------------------------------------------------
# Validation


def _nearest_divisors(n: int, near: int) -> str:
    divs = divisors(n)
    divs.sort(key=lambda d: (abs(d - near), d))
    return ", ".join(str(d) for d in sorted(divs[:3]))


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first impossible value."""
    for (section, key), allowed in CHOICES.items():
        value = getattr(getattr(cfg, section), _KEY_ALIASES.get((section, key), key))
        if value not in allowed:
            raise ConfigError(f"{section}.{key} = {value!r}: choose one of {', '.join(allowed)}")
    for name in cfg.logging.trackers:
        if name not in TRACKERS:
            raise ConfigError(f"logging.trackers: {name!r} is not a tracker; choose from "
                              f"{', '.join(TRACKERS)}")
    m, t, p = cfg.model, cfg.train, cfg.parallel
    positive = [("model", "n_layers", m.n_layers), ("model", "dim", m.dim),
                ("model", "n_heads", m.n_heads), ("model", "n_kv_heads", m.n_kv_heads),
                ("model", "ffn_dim", m.ffn_dim), ("model", "vocab_size", m.vocab_size),
                ("model", "max_seq_len", m.max_seq_len), ("train", "steps", t.steps),
                ("train", "batch_size", t.batch_size), ("train", "seq_len", t.seq_len),
                ("train", "grad_accum", t.grad_accum), ("train", "log_every", t.log_every),
                ("train", "goldfish_k", t.goldfish_k), ("train", "goldfish_h", t.goldfish_h),
                ("parallel", "x", p.x), ("parallel", "y", p.y), ("parallel", "z", p.z)]
    for section, key, value in positive:
        if value < 1:
            raise ConfigError(f"{section}.{key} = {value}: must be at least 1")
    _validate_method(t)
    if isinstance(t.weight_decay, str) and t.weight_decay != "auto":
        raise ConfigError(f"train.weight_decay = {t.weight_decay!r}: expected a number or "
                          f"\"auto\" (the method's own: "
                          f"{method_spec(t.optimizer).weight_decay:g} for {t.optimizer})")
    non_negative = [("train", "lr", t.lr), ("train", "warmup_steps", t.warmup_steps),
                    ("train", "weight_decay", t.effective_weight_decay()),
                    ("train", "grad_clip", t.grad_clip),
                    ("train", "eval_every", t.eval_every), ("checkpoint", "every",
                                                            cfg.checkpoint.every),
                    ("checkpoint", "keep", cfg.checkpoint.keep)]
    for section, key, value in non_negative:
        if value < 0:
            raise ConfigError(f"{section}.{key} = {value}: must not be negative")
    if isinstance(cfg.checkpoint.async_save, str) and cfg.checkpoint.async_save != "auto":
        raise ConfigError(f"checkpoint.async = {cfg.checkpoint.async_save!r}: expected true, "
                          "false or \"auto\"")
    if t.loss == "goldfish" and t.goldfish_k < 2:
        raise ConfigError(f"train.goldfish_k = {t.goldfish_k}: the goldfish loss drops 1 token in "
                          "k; use at least 2 (the paper uses 4)")
    if m.dim % m.n_heads:
        raise ConfigError(f"model.n_heads = {m.n_heads} does not divide model.dim = {m.dim}; "
                          f"nearest valid n_heads: {_nearest_divisors(m.dim, m.n_heads)}")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads = {m.n_kv_heads} does not divide model.n_heads = "
                          f"{m.n_heads}; nearest valid: "
                          f"{_nearest_divisors(m.n_heads, m.n_kv_heads)}")
    if m.head_dim % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.head_dim}: RoPE needs an even head "
                          "dimension")
    _validate_rope_scaling(m)
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len = {t.seq_len} is longer than model.max_seq_len = "
                          f"{m.max_seq_len}; use at most {m.max_seq_len}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.grad_accum = {t.grad_accum} does not divide train.batch_size = "
                          f"{t.batch_size}; nearest valid: "
                          f"{_nearest_divisors(t.batch_size, t.grad_accum)}")
    if not math.isfinite(t.lr):
        raise ConfigError(f"train.lr = {t.lr}: must be a finite number")
    if isinstance(p.data, str) and p.data != "auto":
        raise ConfigError(f"parallel.data = {p.data!r}: expected a positive integer or \"auto\"")
    if isinstance(p.data, int) and p.data < 1:
        raise ConfigError(f"parallel.data = {p.data}: must be at least 1 or \"auto\"")
    _validate_adapter(cfg)


# model.<key> -> the rope_scaling kinds it applies to (set under another, it is refused)
ROPE_SCALING_OPTIONS: dict[str, tuple[str, ...]] = {
    "rope_factor": ("linear", "llama3"),
    "rope_low_freq_factor": ("llama3",),
    "rope_high_freq_factor": ("llama3",),
    "rope_original_max_seq_len": ("llama3",),
}


def _refuse_options_of_other_kinds(section: str, obj: Any, kind: str,
                                   options: dict[str, tuple[str, ...]]) -> None:
    """ConfigError for the first option of `options` (key -> the values of section.kind it
    applies to) set away from its default while `kind` is something else: refused rather
    than silently ignored."""
    defaults = type(obj)()
    for key, users in options.items():
        if getattr(obj, kind) not in users and getattr(obj, key) != getattr(defaults, key):
            raise ConfigError(f"{section}.{key} = {getattr(obj, key)!r} applies only to "
                              f"{section}.{kind} = {' or '.join(map(repr, users))}, not "
                              f"{getattr(obj, kind)!r}; remove it")


def _validate_rope_scaling(m: ModelConfig) -> None:
    _refuse_options_of_other_kinds("model", m, "rope_scaling", ROPE_SCALING_OPTIONS)
    if not (m.rope_factor >= 1.0 and math.isfinite(m.rope_factor)):
        raise ConfigError(f"model.rope_factor = {m.rope_factor}: must be a number of at least 1")
    if m.rope_scaling == "llama3":
        if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
            raise ConfigError(f"model.rope_low_freq_factor = {m.rope_low_freq_factor} and "
                              f"model.rope_high_freq_factor = {m.rope_high_freq_factor}: need "
                              "0 < low < high")
        if m.rope_original_max_seq_len < 1:
            raise ConfigError(f"model.rope_original_max_seq_len = "
                              f"{m.rope_original_max_seq_len}: must be at least 1")


def adapter_layer_dims(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapter target's layer."""
    kv = m.n_kv_heads * m.head_dim
    return {"q": (m.dim, m.dim), "k": (m.dim, kv), "v": (m.dim, kv), "o": (m.dim, m.dim),
            "gate": (m.dim, m.ffn_dim), "up": (m.dim, m.ffn_dim), "down": (m.ffn_dim, m.dim),
            "output": (m.dim, m.vocab_size)}


def _validate_adapter(cfg: Config) -> None:
    a = cfg.adapter
    if a.kind == "none":
        return
    if cfg.model.init_from and not Path(cfg.model.init_from).exists():
        raise ConfigError(f"model.init_from = {cfg.model.init_from!r} does not exist; an adapter "
                          "fine-tunes a checkpoint: give a Hugging Face checkpoint directory")
    optimizer = cfg.train.optimizer
    if not method_spec(optimizer).trains_subsets:
        able = [n for n in method_names() if method_spec(n).trains_subsets]
        raise ConfigError(f"train.optimizer = {optimizer!r} cannot train a subset of the "
                          f"parameters, as adapter.kind = {a.kind!r} needs; use "
                          f"{' or '.join(able)}")
    if a.kind != "lora":
        return
    unknown = [t for t in a.targets if t not in ADAPTER_TARGETS]
    if unknown:
        raise ConfigError(f"adapter.targets: {unknown[0]!r} is not a layer of the model"
                          f"{_suggest(unknown[0], list(ADAPTER_TARGETS))}; choose from "
                          f"{', '.join(ADAPTER_TARGETS)}")
    if not a.targets:
        raise ConfigError("adapter.targets is empty; choose from " + ", ".join(ADAPTER_TARGETS))
    if "output" in a.targets and cfg.model.tie_embeddings:
        raise ConfigError("adapter.targets: 'output' is tied to the embedding "
                          "(model.tie_embeddings = true), so its LoRA term cannot be merged; "
                          "leave 'output' out")
    dims = adapter_layer_dims(cfg.model)
    smallest = min(a.targets, key=lambda t: min(dims[t]))
    if a.r < 1 or a.r > min(dims[smallest]):
        raise ConfigError(f"adapter.r = {a.r}: must be from 1 to {min(dims[smallest])}, the "
                          f"smaller dimension of the {smallest!r} layer "
                          f"({dims[smallest][0]} -> {dims[smallest][1]})")
    if not a.alpha > 0:
        raise ConfigError(f"adapter.alpha = {a.alpha}: must be positive")
    if not 0 <= a.dropout < 1:
        raise ConfigError(f"adapter.dropout = {a.dropout}: must be in [0, 1)")


def _validate_method(t: TrainConfig) -> None:
    """train.optimizer names a known method, train.method holds its options, and they and the
    rest of [train] are what the method can run with."""
    spec = method_spec(t.optimizer)
    if t.method is not None and not isinstance(t.method, spec.options):
        raise ConfigError(f"train.method holds {type(t.method).__name__}, not the options of "
                          f"train.optimizer = {t.optimizer!r} ({spec.options.__name__})")
    if t.grad_accum > 1 and not spec.accumulates:
        raise ConfigError(f"train.grad_accum = {t.grad_accum}: {t.optimizer} updates each "
                          "weight during backward, so it cannot accumulate; use 1")
    t.options().check(t)


# --------------------------------------------------------------------------------------------
# TOML output (the standard library reads TOML but does not write it)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(data: dict[str, dict[str, Any]]) -> str:
    """TOML of sections of keys; a dict among a section's values is its sub-table
    ([section.key]), written after the section's own keys."""
    lines: list[str] = []
    for section, table in data.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if not isinstance(value, dict):
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
        for key, value in table.items():
            if isinstance(value, dict):
                lines.append(f"[{section}.{key}]")
                lines.extend(f"{k} = {_toml_value(v)}" for k, v in value.items())
                lines.append("")
    return "\n".join(lines)
