"""Llama-family models: the decoder, presets, and the Hugging Face mapping."""

from fourfold.config import PRESETS, ModelConfig, model_config
from fourfold.models.llama import KVCache, Llama, build_model, flops_per_token

__all__ = ["PRESETS", "KVCache", "Llama", "ModelConfig", "build_model", "flops_per_token",
           "model_config"]
