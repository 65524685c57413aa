"""Mapping between fourfold's Llama and Hugging Face LlamaForCausalLM (and Mistral/Qwen2-style
checkpoints that share its layout). Both use the rotate-half RoPE layout, so weights move by
name alone, without permutation."""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from fourfold.config import ModelConfig

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
