"""Adapters on a Llama-family model: which layers LoRA adapts, which gains norm tuning trains,
and the Hugging Face side (peft's adapter files, a merged checkpoint).

`apply_adapter` is the one call a run builder makes, after parallelize (and after loading the
base weights): it freezes the base and leaves only the adapter trainable. It works on the
fourfold Llama and on a Hugging Face LlamaForCausalLM, on one process and on any grid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from fourfold.config import ADAPTER_TARGETS, AdapterConfig, Config, ConfigError, ModelConfig
from fourfold.models.hf import fourfold_to_hf_name, state_dict_to_hf
from fourfold.parallel.lora import ForwardCounter, LoRAError, LoRASpec, add_lora, lora_layers
from fourfold.safetensors_stream import TensorSpec

if TYPE_CHECKING:
    from fourfold.parallel import ParallelModel

# adapter target -> the leaf names of that layer (fourfold's, then Hugging Face's)
TARGET_LEAVES: dict[str, tuple[str, ...]] = {
    **{t: (f"{t}_proj",) for t in ("q", "k", "v", "o", "gate", "up", "down")},
    "output": ("output", "lm_head"),
}
_PEFT_PREFIX = "base_model.model."


def _root(model: Any) -> nn.Module:
    return model.module if hasattr(model, "module") and not isinstance(model, nn.Module) \
        else model


def _is_norm(name: str, module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (name.rsplit(".", 1)[-1].endswith("norm") and isinstance(weight, nn.Parameter)
            and weight.dim() == 1)


def apply_adapter(model: Any, cfg: AdapterConfig, seed: int) -> list[str]:
    """Freeze the base of `model` (a ParallelModel or an nn.Module) and add the adapter that
    `cfg` describes; returns the names of the trainable parameters. kind = "none": no change."""
    root = _root(model)
    if cfg.kind == "none":
        return [n for n, p in root.named_parameters() if p.requires_grad]
    for p in root.parameters():
        p.requires_grad_(False)
    if cfg.kind == "lora":
        counter = ForwardCounter()
        root.register_forward_pre_hook(counter.tick)
        spec = LoRASpec(cfg.r, cfg.alpha, cfg.dropout)
        found: set[str] = set()
        leaves = {leaf: t for t in cfg.targets for leaf in TARGET_LEAVES[t]}
        for name, module in list(root.named_modules()):
            target = leaves.get(name.rsplit(".", 1)[-1])
            if target is None:
                continue
            try:
                add_lora(module, name, spec, seed, counter)
            except LoRAError as e:
                raise ConfigError(str(e)) from None
            found.add(target)
        missing = [t for t in cfg.targets if t not in found]
        if missing:
            raise ConfigError(f"adapter.targets: the model has no {missing[0]!r} layer "
                              f"({'/'.join(TARGET_LEAVES[missing[0]])}); choose from "
                              f"{', '.join(t for t in ADAPTER_TARGETS if t in found) or '-'}")
        for layer in lora_layers(root).values():
            layer.lora_A.weight.requires_grad_(True)
            layer.lora_B.weight.requires_grad_(True)
    if cfg.train_norms or cfg.kind == "norm":
        for name, module in root.named_modules():
            if _is_norm(name, module):
                module.weight.requires_grad_(True)
    if cfg.kind == "norm" and cfg.train_output:
        for name, module in root.named_modules():
            if name.rsplit(".", 1)[-1] in TARGET_LEAVES["output"]:
                module.weight.requires_grad_(True)
    if hasattr(model, "parameters_changed"):  # a ParallelModel caches layouts and groups
        model.parameters_changed()
    return [n for n, p in root.named_parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------
# Hugging Face: peft's adapter files and a merged checkpoint


def _is_factor(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def _hf_name(name: str, hf_names: bool) -> str:
    return name if hf_names else fourfold_to_hf_name(name)


def _is_norm_weight(name: str, t: torch.Tensor) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rsplit(".", 1)[-1].endswith("norm") and t.dim() == 1


def _is_output_weight(name: str) -> bool:
    return name.rsplit(".", 1)[0].rsplit(".", 1)[-1] in TARGET_LEAVES["output"] \
        and name.endswith(".weight")


def is_adapter_tensor(name: str, t: torch.Tensor, cfg: AdapterConfig) -> bool:
    """Whether `name` (a full state dict's) is part of what the adapter `cfg` trains: the LoRA
    factors, the tuned norm gains, the output layer of norm tuning with train_output."""
    if cfg.kind == "none":
        return False
    if _is_factor(name):
        return True
    if (cfg.kind == "norm" or cfg.train_norms) and _is_norm_weight(name, t):
        return True
    return cfg.kind == "norm" and cfg.train_output and _is_output_weight(name)


def _hf_module(name: str, hf_names: bool) -> str:
    """The Hugging Face module of a parameter (model.layers.0.input_layernorm for
    layers.0.attn_norm.weight)."""
    if _is_factor(name):
        layer = name[:-len(".lora_A.weight")]
        return _hf_name(layer + ".weight", hf_names)[:-len(".weight")]
    return _hf_name(name, hf_names).rsplit(".", 1)[0]


def peft_state_dict(state: Mapping[str, torch.Tensor], cfg: AdapterConfig,
                    hf_names: bool = False) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a state dict (full, or the adapter's alone) under peft's key
    names: base_model.model.<HF layer>.lora_A.weight for LoRA factors; <HF norm>.weight for
    LoRA's modules_to_save; <HF norm>.ln_tuning_layers.weight for LN tuning (kind = norm),
    whose output layer is a module to save (lm_head.weight)."""
    out = {}
    for name, t in state.items():
        if not is_adapter_tensor(name, t, cfg):
            continue
        module = _hf_module(name, hf_names)
        if _is_factor(name):
            key = f"{module}.{name[-len('lora_A.weight'):]}"
        elif cfg.kind == "norm" and _is_norm_weight(name, t):
            key = f"{module}.ln_tuning_layers.weight"
        else:
            key = f"{module}.weight"
        out[_PEFT_PREFIX + key] = t.detach().cpu().contiguous().clone()
    return out


_HF_NORMS = ["input_layernorm", "post_attention_layernorm", "norm"]


def peft_config(cfg: AdapterConfig, base_model: str = "") -> dict[str, Any]:
    """adapter_config.json as peft writes it: LoRA (peft_type LORA, trained norms as
    modules_to_save) or LN tuning (LN_TUNING, for kind = norm)."""
    if cfg.kind == "norm":
        return {"peft_type": "LN_TUNING", "task_type": "CAUSAL_LM",
                "base_model_name_or_path": base_model, "target_modules": _HF_NORMS,
                "exclude_modules": None, "inference_mode": True, "revision": None,
                "modules_to_save": ["lm_head"] if cfg.train_output else None}
    targets = sorted({TARGET_LEAVES[t][-1] for t in cfg.targets})  # the HF leaf names
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.r, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": _HF_NORMS if cfg.train_norms else None,
        "use_rslora": False, "use_dora": False, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def save_peft_adapter(state: Mapping[str, torch.Tensor], cfg: AdapterConfig,
                      out_dir: str | Path, base_model: str = "", hf_names: bool = False,
                      tie_embeddings: bool = False) -> list[Path]:
    """Write adapter_model.safetensors and adapter_config.json from a state dict (full, or
    the adapter's tensors alone), loadable with peft.PeftModel.from_pretrained(base, out_dir)."""
    from safetensors.torch import save_file

    if cfg.kind == "none":
        raise ConfigError("adapter.kind = 'none': the run has no adapter to export")
    if cfg.kind == "norm" and cfg.train_output and tie_embeddings:
        raise ConfigError("adapter.train_output = true with tied embeddings: peft saves lm_head "
                          "apart from the embedding it is tied to; export the merged model")
    weights = peft_state_dict(state, cfg, hf_names)
    if not weights:
        raise ConfigError("the model has no adapter tensors to export")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights_file, config = out / "adapter_model.safetensors", out / "adapter_config.json"
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    config.write_text(json.dumps(peft_config(cfg, base_model), indent=2) + "\n")
    return [weights_file, config]


def _merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return (w.double() + (b.double() @ a.double()) * scale).to(w.dtype)


def merged_state_dict(full_state: Mapping[str, torch.Tensor], cfg: AdapterConfig
                      ) -> dict[str, torch.Tensor]:
    """The base weights with each LoRA term folded in (W + alpha/r B A), factors dropped."""
    scale = cfg.alpha / cfg.r
    out = {n: t.detach().clone() for n, t in full_state.items() if not _is_factor(n)}
    for name, a in full_state.items():
        if not name.endswith(".lora_A.weight"):
            continue
        layer = name[:-len(".lora_A.weight")]
        w = out[layer + ".weight"]
        out[layer + ".weight"] = _merge(w, a, full_state[layer + ".lora_B.weight"], scale)
    return out


def merge_stream(specs: Sequence[TensorSpec],
                 tensors: Iterable[tuple[TensorSpec, torch.Tensor | None]], cfg: AdapterConfig,
                 adapter_out: dict[str, torch.Tensor] | None = None
                 ) -> tuple[list[TensorSpec], Iterator[tuple[TensorSpec, torch.Tensor | None]]]:
    """The merged model as specs and a stream, from a model's stream (as
    ParallelModel.stream_full_tensors yields it: a layer's weight before its factors): each
    adapted weight is held only until its factors arrive, then yielded as W + alpha/r B A, so
    the writer holds one weight at a time. The adapter's tensors go into `adapter_out` (small:
    for the peft files). Tensors may be None (ranks that do not write): passed on as None."""
    names = {s.name for s in specs}
    adapted = {s.name[:-len(".lora_A.weight")] + ".weight" for s in specs
               if s.name.endswith(".lora_A.weight")}
    missing = sorted(adapted - names)
    if missing:  # a tied output layer's weight is the embedding's, streamed under its name
        raise ConfigError(f"{missing[0]}: is tied to another tensor, so its LoRA term cannot "
                          "be merged; leave 'output' out of adapter.targets")
    by_name = {s.name: s for s in specs}
    out_specs = []
    for s in specs:
        if s.name.endswith(".lora_B.weight"):
            out_specs.append(by_name[s.name[:-len(".lora_B.weight")] + ".weight"])
        elif not _is_factor(s.name) and s.name not in adapted:
            out_specs.append(s)
    scale = cfg.alpha / cfg.r

    def run() -> Iterator[tuple[TensorSpec, torch.Tensor | None]]:
        held: dict[str, torch.Tensor | None] = {}
        for spec, t in tensors:
            if adapter_out is not None and t is not None and is_adapter_tensor(spec.name, t, cfg):
                adapter_out[spec.name] = t.detach().cpu().clone()
            if spec.name in adapted or spec.name.endswith(".lora_A.weight"):
                held[spec.name] = t
            elif spec.name.endswith(".lora_B.weight"):
                layer = spec.name[:-len(".lora_B.weight")]
                w, a = held.pop(layer + ".weight"), held.pop(layer + ".lora_A.weight")
                merged = None if w is None or a is None or t is None else _merge(w, a, t, scale)
                del w
                yield by_name[layer + ".weight"], merged
            else:
                yield spec, t
        if held:
            raise RuntimeError(f"merge_stream: no factors came for {sorted(held)[:2]}")

    return out_specs, run()


def save_merged_hf(full_state: Mapping[str, torch.Tensor], cfg: AdapterConfig,
                   model_cfg: ModelConfig, out_dir: str | Path) -> list[Path]:
    """A Hugging Face checkpoint (model.safetensors, config.json) of the merged fourfold Llama."""
    from safetensors.torch import save_file

    from fourfold.models.hf import config_to_hf

    merged = merged_state_dict(full_state, cfg)
    if model_cfg.tie_embeddings and "output.weight" in merged and "embed.weight" in merged \
            and not torch.equal(merged["output.weight"], merged["embed.weight"]):
        raise ConfigError("the output layer is tied to the embedding, so its LoRA term cannot be "
                          "merged; leave 'output' out of adapter.targets")
    hf_state = {n: t.detach().cpu().contiguous().clone()
                for n, t in state_dict_to_hf(merged, model_cfg).items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights, config = out / "model.safetensors", out / "config.json"
    save_file(hf_state, str(weights), metadata={"format": "pt"})
    config.write_text(json.dumps(config_to_hf(model_cfg), indent=2) + "\n")
    return [weights, config]


def write_adapter_run(pmodel: ParallelModel, cfg: Config, run_dir: str | Path, weights_path: Path,
                      writer_rank: int = 0) -> None:
    """At the end of an adapter run (`cfg` a Config): write the merged model to
    `weights_path` (fourfold's safetensors, so that generate, eval and convert use the adapted
    model with no adapter code), streamed one tensor at a time, and the adapter alone in
    peft's files under RUN_DIR/adapter. Collective: every rank of the grid calls it."""
    from fourfold.safetensors_stream import write_streamed

    writer = pmodel.grid.rank == writer_rank
    adapter: dict[str, torch.Tensor] = {}
    specs, stream = merge_stream(pmodel.full_tensor_specs(),
                                 pmodel.stream_full_tensors(writer_rank), cfg.adapter, adapter)
    tie = cfg.model.tie_embeddings
    keep = {s.name: s.name for s in specs if not (tie and s.name == "output.weight")}
    write_streamed(weights_path if writer else None, specs, stream, {"format": "fourfold"},
                   keep)
    if writer and not (cfg.adapter.kind == "norm" and cfg.adapter.train_output and tie):
        save_peft_adapter(adapter, cfg.adapter, Path(run_dir) / "adapter",
                          base_model=cfg.model.init_from, tie_embeddings=tie)


def export_base_and_adapter(cfg: Any, run_dir: str | Path, out_dir: str | Path,
                            named: str | Path | None = None) -> list[Path]:
    """`fourfold convert RUN --to hf OUT` of an adapter run without --merge: OUT holds the
    frozen base as a Hugging Face checkpoint (model.init_from's JSON and safetensors files,
    copied) and OUT/adapter the run's peft files, whose base_model_name_or_path is `named`
    (where OUT will be, when it is written elsewhere first), else OUT."""
    import shutil

    base, adapter = cfg.model.init_from, Path(run_dir) / "adapter"
    if not base:
        raise ConfigError(f"{run_dir}: the adapter's base was built from train.seed, not read "
                          "from model.init_from, so there is no base checkpoint to export; "
                          "use --merge")
    if not (adapter / "adapter_config.json").is_file():
        raise ConfigError(f"{run_dir}: no peft adapter files in {adapter} (tied embeddings with "
                          "adapter.train_output, or a run still training); use --merge")
    root, out = Path(base), Path(out_dir)
    files = sorted(f for f in root.iterdir()
                   if f.is_file() and f.suffix in (".json", ".safetensors"))
    if not any(f.suffix == ".safetensors" for f in files):
        raise ConfigError(f"model.init_from = {base!r}: no safetensors files to export")
    (out / "adapter").mkdir(parents=True, exist_ok=True)
    written = []
    for f in files:
        shutil.copy2(f, out / f.name)
        written.append(out / f.name)
    shutil.copy2(adapter / "adapter_model.safetensors", out / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(out if named is None else named)
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written + [out / "adapter" / "adapter_model.safetensors",
                      out / "adapter" / "adapter_config.json"]
