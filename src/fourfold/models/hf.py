"""Mapping between fourfold's Llama and Hugging Face LlamaForCausalLM (and Mistral/Qwen2-style
checkpoints that share its layout), and the files on both sides: reading a local HF checkpoint
into a (parallel) model, and writing a trained model as one. Both use the rotate-half RoPE
layout, so weights move by name alone, without permutation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from fourfold.config import ConfigError, ModelConfig
from fourfold.errors import first_line
from fourfold.files import atomic_write_text
from fourfold.safetensors_stream import TensorSpec, write_streamed

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"


class InitFromError(ConfigError):
    """model.init_from names something that is not a usable Hugging Face checkpoint."""

# fourfold name pattern -> HF name pattern ({i} is the layer index)
_LAYER_MAP = {
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"layers.{{i}}.attn.{p}_proj.{t}": f"model.layers.{{i}}.self_attn.{p}_proj.{t}"
       for p in "qkvo" for t in ("weight", "bias")},
    **{f"layers.{{i}}.ffn.{p}_proj.{t}": f"model.layers.{{i}}.mlp.{p}_proj.{t}"
       for p in ("gate", "up", "down") for t in ("weight", "bias")},
}
_GLOBAL_MAP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def fourfold_to_hf_name(name: str) -> str:
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    if m:
        key = "layers.{i}." + m.group(2)
        if key in _LAYER_MAP:
            return _LAYER_MAP[key].format(i=m.group(1))
    raise KeyError(f"no Hugging Face name for fourfold parameter {name!r}")


def hf_to_fourfold_name(name: str) -> str:
    for ours, theirs in _GLOBAL_MAP.items():
        if name == theirs:
            return ours
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m:
        key = "model.layers.{i}." + m.group(2)
        for ours, theirs in _LAYER_MAP.items():
            if theirs == key:
                return ours.format(i=m.group(1))
    raise KeyError(f"unknown Hugging Face parameter {name!r}")


def state_dict_from_hf(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig
                       ) -> dict[str, torch.Tensor]:
    """An HF Llama state dict renamed for fourfold's Llama (rotary buffers are dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if "rotary_emb" in name:
            continue
        out[hf_to_fourfold_name(name)] = tensor
    if cfg.tie_embeddings:
        out.setdefault("output.weight", out["embed.weight"])
    return out


def state_dict_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig
                     ) -> dict[str, torch.Tensor]:
    out = {fourfold_to_hf_name(k): v for k, v in state.items() if not k.startswith("rope_")}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from an HF config.json dict (Llama, Mistral, Qwen2)."""
    n_heads = hf_config["num_attention_heads"]
    dim = hf_config["hidden_size"]
    head_dim = hf_config.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise ValueError(f"head_dim {head_dim} x heads {n_heads} != hidden_size {dim}: "
                         "not supported")
    return ModelConfig(
        preset="custom",
        n_layers=hf_config["num_hidden_layers"], dim=dim, n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        ffn_dim=hf_config["intermediate_size"], vocab_size=hf_config["vocab_size"],
        max_seq_len=hf_config.get("max_position_embeddings", 2048),
        rope_theta=float(hf_config.get("rope_theta")
                         or (hf_config.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-5)),
        bias=bool(hf_config.get("attention_bias", False)),
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """An HF LlamaConfig dict (config.json) for fourfold's model config."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias, "hidden_act": "silu", "torch_dtype": "float32",
    }


# --------------------------------------------------------------------------------------------
# Reading a local Hugging Face checkpoint (model.init_from)


def hf_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a local Hugging Face checkpoint directory (config.json)."""
    config_file = Path(path) / HF_CONFIG_FILE
    if not config_file.is_file():
        raise InitFromError(f"model.init_from = {str(path)!r}: no config.json there; expected a "
                            "local Hugging Face checkpoint directory")
    try:
        return config_from_hf(json.loads(config_file.read_text()))
    except (ValueError, KeyError) as e:
        raise InitFromError(f"model.init_from = {str(path)!r}: config.json is not a supported "
                            f"Llama-family config ({first_line(e)})") from None


def _hf_weight_files(root: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded index)."""
    index = root / HF_WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / HF_WEIGHTS_FILE
    if not single.is_file():
        raise InitFromError(f"model.init_from = {str(root)!r}: no model.safetensors or "
                            "model.safetensors.index.json there (only safetensors are read)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_hf_into(pmodel: Any, path: str | Path) -> None:
    """Fill every local shard of `pmodel` from a local Hugging Face safetensors checkpoint.
    Each rank reads only the slices it owns (never the full model). Works for fourfold's Llama
    (names mapped) and for HF modules parallelized directly (names as they are).

    `pmodel` is a parallel model (duck-typed: named_parameters(), layouts() of Layouts with
    local_shape/offsets, and grid with shape and rank), so that models/ needs nothing from
    parallel/."""
    from safetensors import safe_open

    root = Path(path)
    where = _hf_weight_files(root)
    layouts = pmodel.layouts()
    shape = pmodel.grid.shape
    coords = shape.coords(pmodel.grid.rank)
    handles: dict[Path, Any] = {}
    try:
        for name, param in pmodel.named_parameters():
            hf_name = name if name in where else _hf_name(name, where, fourfold_to_hf_name)
            file = where[hf_name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            piece = handles[file].get_slice(hf_name)
            full_shape = tuple(piece.get_shape())
            layout = layouts[name]
            local = layout.local_shape(full_shape, shape, name)
            if local != tuple(param.shape):
                raise InitFromError(f"model.init_from = {str(root)!r}: {hf_name} has shape "
                                    f"{full_shape}, which does not fit {name} "
                                    f"(local {tuple(param.shape)} on grid {shape})")
            offsets = layout.offsets(full_shape, shape, coords)
            block = piece[tuple(slice(o, o + n) for o, n in zip(offsets, local))]
            param.copy_(block.to(param.dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def _hf_name(name: str, where: dict[str, Path], to_hf: Any) -> str:
    try:
        hf_name = to_hf(name)
    except KeyError:
        hf_name = name
    if hf_name in where:
        return hf_name
    if hf_name == "lm_head.weight" and "model.embed_tokens.weight" in where:
        return "model.embed_tokens.weight"  # tied word embeddings store one matrix
    raise InitFromError(f"the Hugging Face checkpoint has no tensor {hf_name!r} (for {name}); "
                        "is it a Llama-family model of the configured shape?")

# --------------------------------------------------------------------------------------------
# Writing a Hugging Face checkpoint (fourfold convert --to hf)


def save_hf_checkpoint(specs: Sequence[TensorSpec],
                       tensors: Iterable[tuple[TensorSpec, torch.Tensor | None]],
                       cfg: ModelConfig, out_dir: str | Path) -> list[Path]:
    """Write a full fourfold model, given as tensor specs and the tensors one at a time (see
    `write_streamed`: the writer never holds the whole model), as a Hugging Face Llama
    checkpoint (config.json and model.safetensors) that `LlamaForCausalLM.from_pretrained(out_dir)`
    loads; returns the two paths."""
    hf_names = {s.name: fourfold_to_hf_name(s.name) for s in specs
                if not s.name.startswith("rope_")
                and not (cfg.tie_embeddings and s.name == "output.weight")}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / HF_WEIGHTS_FILE
    config = out / HF_CONFIG_FILE
    write_streamed(weights, specs, tensors, {"format": "pt"}, hf_names)
    atomic_write_text(config, json.dumps(config_to_hf(cfg), indent=2) + "\n")
    return [config, weights]
