"""Adapters on a Llama-family model: which layers LoRA adapts, which gains norm tuning trains,
and the Hugging Face side (peft's adapter files, a merged checkpoint).

`apply_adapter` is the one call a run builder makes, after parallelize (and after loading the
base weights): it freezes the base and leaves only the adapter trainable. It works on the
fourfold Llama and on a Hugging Face LlamaForCausalLM, on one process and on any grid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from fourfold.config import ADAPTER_TARGETS, AdapterConfig, ConfigError, ModelConfig
from fourfold.models.hf import fourfold_to_hf_name, state_dict_to_hf
from fourfold.parallel.lora import ForwardCounter, LoRAError, LoRASpec, add_lora, lora_layers

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


def peft_state_dict(full_state: Mapping[str, torch.Tensor], hf_names: bool = False
                    ) -> dict[str, torch.Tensor]:
    """The LoRA factors of a full state dict under peft's key names
    (base_model.model.<HF layer>.lora_A.weight)."""
    out = {}
    for name, t in full_state.items():
        if not _is_factor(name):
            continue
        layer, factor = name[:-len(".lora_A.weight")], name[-len("lora_A.weight"):]
        hf_layer = _hf_name(layer + ".weight", hf_names)[:-len(".weight")]
        out[f"{_PEFT_PREFIX}{hf_layer}.{factor}"] = t.detach().cpu().contiguous().clone()
    return out


def peft_config(cfg: AdapterConfig, base_model: str = "") -> dict[str, Any]:
    """adapter_config.json as peft writes it for a LoRA adapter of a causal LM."""
    targets = sorted({TARGET_LEAVES[t][-1] for t in cfg.targets})  # the HF leaf names
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.r, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def save_peft_adapter(full_state: Mapping[str, torch.Tensor], cfg: AdapterConfig,
                      out_dir: str | Path, base_model: str = "", hf_names: bool = False
                      ) -> list[Path]:
    """Write adapter_model.safetensors and adapter_config.json, loadable with
    peft.PeftModel.from_pretrained(base, out_dir)."""
    from safetensors.torch import save_file

    if cfg.kind != "lora":
        raise ConfigError(f"adapter.kind = {cfg.kind!r}: only a LoRA adapter has peft files; "
                          "export the merged model instead")
    if cfg.train_norms:
        raise ConfigError("adapter.train_norms = true: peft's LoRA files cannot hold the tuned "
                          "norm gains; export the merged model instead")
    state = peft_state_dict(full_state, hf_names)
    if not state:
        raise ConfigError("the model has no LoRA factors to export")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights, config = out / "adapter_model.safetensors", out / "adapter_config.json"
    save_file(state, str(weights), metadata={"format": "pt"})
    config.write_text(json.dumps(peft_config(cfg, base_model), indent=2) + "\n")
    return [weights, config]


def merged_state_dict(full_state: Mapping[str, torch.Tensor], cfg: AdapterConfig
                      ) -> dict[str, torch.Tensor]:
    """The base weights with each LoRA term folded in (W + alpha/r B A), factors dropped."""
    scale = cfg.alpha / cfg.r
    out = {n: t.detach().clone() for n, t in full_state.items() if not _is_factor(n)}
    for name, a in full_state.items():
        if not name.endswith(".lora_A.weight"):
            continue
        layer = name[:-len(".lora_A.weight")]
        b = full_state[layer + ".lora_B.weight"]
        w = out[layer + ".weight"]
        delta = (b.double() @ a.double()) * scale
        out[layer + ".weight"] = (w.double() + delta).to(w.dtype)
    return out


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


def finish_adapter(full_state: Mapping[str, torch.Tensor], cfg: Any, run_dir: str | Path
                   ) -> Mapping[str, torch.Tensor]:
    """At the end of a run (`cfg` a Config): write a LoRA adapter alone in peft's files under
    RUN_DIR/adapter, and return the weights to save as the run's model (LoRA merged in, so that
    generate, eval and convert use the adapted model with no adapter code)."""
    a = cfg.adapter
    if a.kind != "lora":
        return full_state
    if not a.train_norms:
        save_peft_adapter(full_state, a, Path(run_dir) / "adapter",
                          base_model=cfg.model.init_from)
    return merged_state_dict(full_state, a)
