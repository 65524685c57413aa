"""The engine's collectives for one optimizer step, as the planner predicts them.

`collective_schedule` lists every collective the 4D engine issues (axis, op, buffer bytes,
how often, and which compute it can hide under); `predict_comm_bytes` sums it into the bytes the
engine's ledger records. The performance model times the same list, so the bytes a test checks
against the engine are the bytes the planner's time estimate is made of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fourfold.config import AdapterConfig, ModelConfig
from fourfold.parallel.embedding import uses_blocked_loss
from fourfold.parallel.engine import keeps_output_block
from fourfold.parallel.grid import AXES, GridShape
from fourfold.parallel.linear import split_rows
from fourfold.plan.errors import PlanError

Op = Literal["all_reduce", "all_gather", "reduce_scatter"]
# When a collective runs, which decides what compute it can hide under:
#   fwd_output  forward all-reduces the next op waits on (outputs, norms, loss): exposed
#   fwd_split   with overlap_forward, the first token half's output all-reduce: under the
#               second half's GEMM
#   fwd_gather  forward z all-gathers, prefetched one layer ahead
#   bwd_gather  backward z all-gathers (incl. recomputation), prefetched one layer ahead
#   bwd_input   input-gradient all-reduces, run under the dW GEMM
#   bwd_weight  dW reduce-scatters over z, run under earlier layers' backward
#   bwd_norm    norm backward all-reduces: exposed
#   bwd_output  the blocked loss's all-reduce of the logits it makes again in backward: exposed
#   step_z      once per step: all-reduce over z of the gradients not split over z: exposed
#   step_data   once per step: gradient all-reduce over data, bucketed under the last backward
#   step_method a training method's own collectives (plan/perf.py: GaLore's projections): exposed
Phase = Literal["fwd_output", "fwd_split", "fwd_gather", "bwd_gather", "bwd_input",
                "bwd_weight", "bwd_norm", "bwd_output", "step_z", "step_data", "step_method"]


@dataclass(frozen=True)
class Collective:
    axis: str  # x, y, z or data
    op: Op
    nbytes: int  # per rank, the buffer as the ledger counts it
    calls: int  # how many times per optimizer step
    phase: Phase
    # ranks in the group where it spans more than `axis` (0: the axis's own): blockllm's
    # all-reduces over the tensor group, x * y * z consecutive ranks, booked on its innermost
    # axis that splits
    group_size: int = 0
    # issued on one optimizer step in `every` (galore's refresh: every galore_gap steps)
    every: int = 1


@dataclass(frozen=True)
class LinearShape:
    name: str
    out_features: int
    in_features: int
    transposed: bool  # transposed layers swap the roles of x and y


def _exact(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise PlanError(f"{what} = {numerator} is not divisible by {denominator}; "
                        "this grid cannot split the model")
    return numerator // denominator


def block_linears(model: ModelConfig) -> list[LinearShape]:
    """The linear layers of one transformer block, in forward order."""
    d, f, kv = model.dim, model.ffn_dim, model.n_kv_heads * model.head_dim
    return [LinearShape("q", d, d, False), LinearShape("k", kv, d, False),
            LinearShape("v", kv, d, False), LinearShape("o", d, d, True),
            LinearShape("gate", f, d, False), LinearShape("up", f, d, False),
            LinearShape("down", d, f, True)]


def fused_units(model: ModelConfig) -> list[list[LinearShape]]:
    """The block's linears as the engine runs them: q, k, v fused, o, gate and up fused,
    down (one z all-gather, GEMM, output all-reduce and dW reduce-scatter per unit)."""
    q, k, v, o, gate, up, down = block_linears(model)
    return [[q, k, v], [o], [gate, up], [down]]


def local_param_numel(model: ModelConfig, shape: GridShape) -> dict[str, int]:
    """Per rank, the numbers of local parameter elements: `z_sharded` (weights split over z),
    `z_replicated` (norm weights and biases, replicated over z). Tied weights count once."""
    gx, gy, gz = shape.x, shape.y, shape.z
    sharded_block = 0
    for lin in block_linears(model):
        sharded_block += _exact(lin.out_features * lin.in_features, gx * gy * gz,
                                f"{lin.name} weight numel")
    embedding = _exact(model.vocab_size * model.dim, gx * gy * gz, "embedding numel")
    output = 0 if model.tie_embeddings else embedding
    norms = (2 * model.n_layers + 1) * _exact(model.dim, gx, "model.dim")
    biases = 0
    if model.bias:
        for lin in block_linears(model):
            split = gx if lin.transposed else gy  # a bias lives where its layer's output does
            biases += _exact(lin.out_features, split, f"{lin.name} bias")
        biases *= model.n_layers
    return {"z_sharded": model.n_layers * sharded_block + embedding + output,
            "z_replicated": norms + biases}


def collective_schedule(model: ModelConfig, shape: GridShape, micro_batch_tokens: int,
                        grad_accum: int, activation_checkpointing: bool, act_bytes: int = 4,
                        weight_bytes: int = 4, grad_bytes: int = 4,
                        residual_bytes: int | None = None, overlap_forward: bool = False,
                        adapter: AdapterConfig | None = None,
                        output_loss: str = "auto") -> list[Collective]:
    """Every collective of one optimizer step, per rank.

    n = micro_batch_tokens: tokens per rank per micro-step (sequences per (data, z) shard per
    micro-step times seq_len). D = dim, F = ffn_dim, V = vocab, KV = n_kv_heads * head_dim.
    Element sizes: weight_bytes: the gathered weights (the compute dtype: the shard is cast
    before the gather); act_bytes: GEMM outputs and input gradients (the compute dtype);
    grad_bytes: gradient reductions (parallel.reduce_dtype); residual_bytes (default
    act_bytes): the embedding's weight and output (it runs outside autocast: float32 under
    bf16 autocast).
    Per micro-step:
    - q, k, v run as one normal linear (out = D + 2 KV), and gate, up as one (out = 2 F):
      their bytes are the sums below, in one call each (`fused_units`).
    - normal linear W[out, in] (q, k, v: out = D, KV, KV; gate, up: out = F; output layer:
      out = V; in = D): forward all-gather z of out*in/(Gx*Gy) * weight_bytes, all-reduce x of
      the output n*out/Gy * act_bytes; backward all-gather z again, reduce-scatter z of dW
      (out*in/(Gx*Gy) * grad_bytes).
    - transposed linear (o: D x D, down: in = F, out = D): forward all-gather z, all-reduce y of
      the output n*out/Gx * act_bytes; backward all-gather z, reduce-scatter z of dW, and the
      input-gradient all-reduce over x of n*in/Gy * act_bytes.
    - input-gradient all-reduces over y of the normal layers, fused per shared input: q,k,v
      together, gate,up together, the output layer: n*D/Gx * act_bytes each.
    - RMSNorm (2 per layer + final, features split over x): forward all-reduce x of n fp32
      values (4n bytes), backward another 4n.
    - embedding [V, D]: forward all-gather z (V*D/(Gx*Gy) * residual_bytes), all-reduce y of
      n*D/Gx * residual_bytes; backward reduce-scatter z
      (V*D/(Gx*Gy) * grad_bytes); no backward all-gather. Tied embeddings: the output layer
      still does its own gathers and scatter.
    - the output layer's backward all-gather is skipped when it keeps its forward's block
      (`keeps_output_block`: the block is no larger than its logits and the loss's fp32
      workspace, D/Gx * weight_bytes <= n * (act_bytes + 4)).
    - vocabulary-parallel cross-entropy: forward all-reduce y of 3n fp32 values (12n bytes).
    - the output layer and the loss in blocks of the vocabulary (parallel.output_loss =
      "blocks", as a lean method resolves "auto"): the same bytes in a call per block (the
      output all-reduce is not split in halves); backward makes the logits again: one more
      all-reduce x of the output, exposed (this list is a step with backward).
    - overlap_forward: every GEMM-output all-reduce (the units above and the output layer)
      runs as two, over the token halves `split_rows(n)`.
    - activation checkpointing: each block's forward collectives (z all-gathers, output
      all-reduces, norm forward all-reduces) run again during backward, and the backward uses
      the blocks the recompute gathered (no third gather); embedding, final norm, output layer
      and loss are not recomputed.
    Per optimizer step:
    - all-reduce z of the gradients not split over z (norm weights D/Gx, biases):
      (their local numel) * grad_bytes.
    - all-reduce data of all local gradients: (total local numel) * grad_bytes.
    A collective over an axis of size 1 is not issued and appears nowhere.
    With an adapter (kind = lora, `adapter_collectives`), the frozen base changes this list.
    """
    if micro_batch_tokens < 1 or grad_accum < 1:
        raise PlanError(f"micro_batch_tokens = {micro_batch_tokens}, grad_accum = {grad_accum}: "
                        "both must be at least 1")
    gx, gy = shape.x, shape.y
    n, m, L = micro_batch_tokens, grad_accum, model.n_layers
    d, v = model.dim, model.vocab_size
    replays = 2 if activation_checkpointing else 1  # block forward collectives per micro-step
    d_over_x = _exact(d, gx, "model.dim")
    rb = act_bytes if residual_bytes is None else residual_bytes
    events: list[Collective] = []
    if adapter is not None and adapter.kind not in ("none", "lora"):
        raise PlanError(f"adapter.kind = {adapter.kind!r}: the planner models LoRA only")
    lora = adapter if adapter is not None and adapter.kind == "lora" else None
    # a frozen base: no dW reduce-scatters, and no input gradient below the first block's
    # norm (the embedding is frozen, so block 0's attention norm input needs none)
    train_base = lora is None
    first_fan_out = 1 if lora is None or lora.train_norms else 0

    def add(axis: str, op: Op, nbytes: int, calls: int, phase: Phase) -> None:
        if getattr(shape, axis) > 1 and calls > 0:
            events.append(Collective(axis, op, nbytes, calls, phase))

    def output_reduce(axis: str, per_token: int, calls: int) -> None:
        first, second = split_rows(n) if overlap_forward else (n, 0)
        if second == 0:
            add(axis, "all_reduce", n * per_token, calls, "fwd_output")
            return
        add(axis, "all_reduce", first * per_token, calls, "fwd_split")
        add(axis, "all_reduce", second * per_token, calls, "fwd_output")

    def weight_block(out_f: int, in_f: int, transposed: bool, name: str) -> int:
        out_split, in_split = (gx, gy) if transposed else (gy, gx)
        return _exact(out_f, out_split, f"{name} out") * _exact(in_f, in_split, f"{name} in")

    for unit in fused_units(model):  # q,k,v and gate,up each gather, multiply, reduce as one
        block = sum(weight_block(lin.out_features, lin.in_features, lin.transposed, lin.name)
                    for lin in unit)
        transposed, name = unit[0].transposed, "+".join(lin.name for lin in unit)
        add("z", "all_gather", block * weight_bytes, m * L, "fwd_gather")
        # backward: the recompute's gather (checkpointing) or the backward's own
        add("z", "all_gather", block * weight_bytes, m * L, "bwd_gather")
        if train_base:
            add("z", "reduce_scatter", block * grad_bytes, m * L, "bwd_weight")
        if transposed:
            out_local = _exact(sum(lin.out_features for lin in unit), gx, f"{name} out")
            output_reduce("y", out_local * act_bytes, m * L * replays)
            in_local = _exact(unit[0].in_features, gy, f"{name} in")
            add("x", "all_reduce", n * in_local * act_bytes, m * L, "bwd_input")
        else:
            out_local = sum(_exact(lin.out_features, gy, f"{lin.name} out") for lin in unit)
            output_reduce("x", out_local * act_bytes, m * L * replays)
    # fused input-gradient all-reduces over y: (q, k, v) and (gate, up) per block
    add("y", "all_reduce", n * d_over_x * act_bytes, (2 * L - 1 + first_fan_out) * m,
        "bwd_input")
    # block norms (2 per block), then the final norm (never recomputed)
    add("x", "all_reduce", 4 * n, 2 * m * L * replays, "fwd_output")
    add("x", "all_reduce", 4 * n, (2 * L - (0 if train_base else 1)) * m, "bwd_norm")
    add("x", "all_reduce", 4 * n, m, "fwd_output")
    add("x", "all_reduce", 4 * n, m, "bwd_norm")
    # embedding
    vocab_block = weight_block(v, d, False, "embedding")
    add("z", "all_gather", vocab_block * rb, m, "fwd_gather")
    add("y", "all_reduce", n * d_over_x * rb, m, "fwd_output")
    if train_base:
        add("z", "reduce_scatter", vocab_block * grad_bytes, m, "bwd_weight")
    # output layer (a normal linear, own gathers even when tied) and the loss
    vocab_local = _exact(v, gy, "model.vocab_size")
    add("z", "all_gather", vocab_block * weight_bytes, m, "fwd_gather")
    if uses_blocked_loss(output_loss):  # the logits, in forward and made again in backward
        add("x", "all_reduce", n * vocab_local * act_bytes, m, "fwd_output")
        add("x", "all_reduce", n * vocab_local * act_bytes, m, "bwd_output")
    else:
        output_reduce("x", vocab_local * act_bytes, m)
    if not keeps_output_block(vocab_block * weight_bytes, n * vocab_local * act_bytes,
                              n * vocab_local):
        add("z", "all_gather", vocab_block * weight_bytes, m, "bwd_gather")
    if train_base:
        add("z", "reduce_scatter", vocab_block * grad_bytes, m, "bwd_weight")
    add("y", "all_reduce", n * d_over_x * act_bytes, m, "bwd_input")
    add("y", "all_reduce", 12 * n, m, "fwd_output")
    if lora is not None:
        for c in adapter_collectives(model, shape, lora, n, m, replays, act_bytes):
            add(c.axis, c.op, c.nbytes, c.calls, c.phase)
    # once per optimizer step
    numel = local_param_numel(model, shape) if lora is None else lora_param_numel(model, shape,
                                                                                  lora)
    add("z", "all_reduce", numel["z_replicated"] * grad_bytes, 1, "step_z")
    add("data", "all_reduce", (numel["z_sharded"] + numel["z_replicated"]) * grad_bytes, 1,
        "step_data")
    return events


def _lora_linears(model: ModelConfig, cfg: AdapterConfig) -> list[tuple[LinearShape, int]]:
    """The adapted layers with how many of each there are (per block, or the output layer)."""
    out = [(lin, model.n_layers) for lin in block_linears(model) if lin.name in cfg.targets]
    if "output" in cfg.targets:
        out.append((LinearShape("output", model.vocab_size, model.dim, False), 1))
    return out


def adapter_collectives(model: ModelConfig, shape: GridShape, cfg: AdapterConfig, n: int,
                        m: int, replays: int, act_bytes: int) -> list[Collective]:
    """LoRA's own collectives per optimizer step (parallel/lora.py): each adapted layer
    all-reduces x A^T (n x r) over its input axis in forward (again in a recompute) and its
    twin dL/dh = dy B over its output axis in backward. Axes of size 1 are left out."""
    events = []
    for lin, count in _lora_linears(model, cfg):
        in_axis, out_axis = ("y", "x") if lin.transposed else ("x", "y")
        nbytes = n * cfg.r * act_bytes
        calls = m * count * (replays if lin.name != "output" else 1)
        for axis, c, phase in ((in_axis, calls, "fwd_output"), (out_axis, m * count,
                                                                "bwd_input")):
            if getattr(shape, axis) > 1:
                events.append(Collective(axis, "all_reduce", nbytes, c, phase))  # type: ignore[arg-type]
    return events


def lora_param_numel(model: ModelConfig, shape: GridShape, cfg: AdapterConfig
                     ) -> dict[str, int]:
    """local_param_numel for a LoRA run: only the trainable parameters (the factors, A split
    like the layer's input and B like its output, and trained norms), all replicated over z."""
    numel = 0
    for lin, count in _lora_linears(model, cfg):
        split_in, split_out = (shape.y, shape.x) if lin.transposed else (shape.x, shape.y)
        numel += count * cfg.r * (_exact(lin.in_features, split_in, f"{lin.name} in")
                                  + _exact(lin.out_features, split_out, f"{lin.name} out"))
    if cfg.train_norms:
        numel += (2 * model.n_layers + 1) * _exact(model.dim, shape.x, "model.dim")
    return {"z_sharded": 0, "z_replicated": numel}


def predict_comm_bytes(model_cfg: ModelConfig, shape: GridShape, micro_batch_tokens: int,
                       grad_accum: int, activation_checkpointing: bool, act_bytes: int = 4,
                       weight_bytes: int = 4, grad_bytes: int = 4,
                       residual_bytes: int | None = None, overlap_forward: bool = False,
                       adapter: AdapterConfig | None = None,
                       output_loss: str = "auto") -> dict[str, int]:
    """Bytes per rank per optimizer step that the engine's ledger records, by axis
    ("x", "y", "z", "data"); the schedule is spelled out in `collective_schedule`."""
    totals = {axis: 0 for axis in AXES}
    for c in collective_schedule(model_cfg, shape, micro_batch_tokens, grad_accum,
                                 activation_checkpointing, act_bytes, weight_bytes, grad_bytes,
                                 residual_bytes, overlap_forward, adapter, output_loss):
        totals[c.axis] += c.nbytes * c.calls
    return totals
