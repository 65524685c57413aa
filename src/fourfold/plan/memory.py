"""Memory per rank of a 4D configuration: parameters, gradients, AdamW states, activations
(with and without activation checkpointing), gathered-weight buffers."""

from __future__ import annotations

from dataclasses import dataclass

from fourfold.config import ModelConfig
from fourfold.parallel.grid import GridShape
from fourfold.plan.errors import PlanError
from fourfold.plan.schedule import block_linears, local_param_numel

GIB = 1024**3


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor.

    float32: everything in fp32. bfloat16: autocast, as the engine runs it: fp32 parameters,
    gradients and AdamW states; the z all-gather moves bf16 weights (weight_bytes 2: the shard
    is cast before the gather); GEMM outputs and input gradients are bf16 (act_bytes 2) while
    the residual stream (embedding and norm outputs) stays fp32 (residual_bytes 4). Gradient
    reductions travel in parallel.reduce_dtype (reduce_bytes).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # AdamW: two fp32 states per parameter
    weight_bytes: int  # gathered weights (all-gather over z)
    act_bytes: int  # GEMM outputs
    residual_bytes: int  # the residual stream
    reduce_bytes: int = 4  # gradients on the wire (z reduce-scatter, data all-reduce)

    @classmethod
    def of(cls, dtype: str, reduce_dtype: str = "float32") -> "Precision":
        if reduce_dtype not in ("float32", "bfloat16"):
            raise PlanError(f"reduce_dtype = {reduce_dtype!r}: choose float32 or bfloat16")
        reduce_bytes = 4 if reduce_dtype == "float32" else 2
        if dtype == "float32":
            return cls("float32", 4, 4, 8, 4, 4, 4, reduce_bytes)
        if dtype == "bfloat16":
            return cls("bfloat16", 4, 4, 8, 2, 2, 4, reduce_bytes)
        raise PlanError(f"dtype = {dtype!r}: choose float32 or bfloat16")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the peak of a step."""

    params: int
    grads: int
    optimizer: int
    activations: int
    gathered_weights: int  # prefetched z all-gather buffers and the full dW before its scatter
    logits: int  # output-layer logits and the loss's fp32 workspace

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations
                + self.gathered_weights + self.logits)


def predict_param_memory(model_cfg: ModelConfig, shape: GridShape,
                         precision: Precision | None = None) -> dict[str, int]:
    """Bytes per rank of parameters, gradients and AdamW states (float32 unless told)."""
    p = precision or Precision.of("float32")
    numel = sum(local_param_numel(model_cfg, shape).values())
    return {"params": numel * p.param_bytes, "grads": numel * p.grad_bytes,
            "optimizer": numel * p.optimizer_bytes}


def activation_bytes_per_token(model: ModelConfig, shape: GridShape,
                               precision: Precision) -> dict[str, int]:
    """Per token on a rank: what one block keeps for backward (`block`), the block input a
    checkpointed block keeps instead (`checkpoint`), and what the embedding and the final norm
    keep (`outside`). Measured against autograd's saved tensors in tests/test_memory_model.py.

    Attention assumes a fused SDPA kernel (flash / memory-efficient, as on CPU and CUDA for a
    causal mask): it keeps q, k, v and its output, which it lays out so that the o projection's
    input is a view of it, plus an fp32 log-sum-exp per head; no T x T scores."""
    gx, gy = shape.x, shape.y
    d, f = model.dim, model.ffn_dim
    heads_dim = model.n_heads * model.head_dim
    # per norm: its input, the normalized tensor (saved by the weight multiply), its output
    residual_like = 6 * d // gx
    # k and v are saved after the GQA repeat, so they are as wide as q
    attention = 4 * heads_dim // gy
    mlp = 4 * f // gy  # gate out (silu's input), silu out, up out, their product (down's input)
    stats = 4 * (2 + model.n_heads // gy)  # an fp32 rstd per norm, an fp32 lse per local head
    act, residual = precision.act_bytes, precision.residual_bytes
    # final norm (input, normalized, output) and its rstd; token ids (int64) and the
    # embedding's ownership mask (bool)
    outside = 3 * d // gx * residual + 4 + 9
    return {"block": residual_like * residual + (attention + mlp) * act + stats,
            "checkpoint": d // gx * residual, "outside": outside}


def predict_memory(model: ModelConfig, shape: GridShape, micro_batch_tokens: int,
                   activation_checkpointing: bool, precision: Precision) -> MemoryBreakdown:
    """Peak bytes per rank of one training step."""
    gx, gy = shape.x, shape.y
    states = predict_param_memory(model, shape, precision)
    n = micro_batch_tokens
    per_token = activation_bytes_per_token(model, shape, precision)
    if activation_checkpointing:
        # every block keeps its input; one block at a time is recomputed with full activations
        activations = n * (model.n_layers * per_token["checkpoint"] + per_token["block"])
    else:
        activations = n * model.n_layers * per_token["block"]
    activations += n * per_token["outside"]
    layer_block = sum(lin.out_features * lin.in_features for lin in block_linears(model))
    layer_block //= gx * gy
    vocab_block = model.vocab_size * model.dim // (gx * gy)
    # the current and the prefetched next layer's weights, plus one full dW before its scatter;
    # this also bounds what the engine keeps: a checkpointed block's recomputed weights (one
    # block) through its backward, and the output layer's block from its forward to its
    # backward (only when no larger than the `logits` term: engine.keeps_output_block)
    gathered = max(2 * layer_block * precision.weight_bytes + layer_block * precision.grad_bytes,
                   vocab_block * (precision.weight_bytes + precision.grad_bytes))
    if shape.z == 1:
        gathered = layer_block * precision.grad_bytes  # no gather buffers; still dW per layer
    logits = n * (model.vocab_size // gy) * (precision.act_bytes + 4)
    return MemoryBreakdown(params=states["params"], grads=states["grads"],
                           optimizer=states["optimizer"], activations=activations,
                           gathered_weights=gathered, logits=logits)
