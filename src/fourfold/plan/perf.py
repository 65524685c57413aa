"""Performance model: the time of one optimizer step of a 4D configuration.

Compute: every GEMM a rank runs, at the device's peak times an efficiency that falls for small
or skinny GEMMs (each dimension d contributes d / (d + gemm_half_dim)), or at memory
bandwidth when that is slower; attention and element-wise work are added the same way.
Communication: the collectives of `schedule.collective_schedule`, each a ring over the
bandwidth its group's placement sees (group size = the axis size; stride between its ranks:
`GridShape.stride`, from the grid's rank order), all-reduces as NCCL's tree when that is
faster (`collective_seconds`), minus the part the engine's overlap hides. Hidden communication
costs the compute it runs under the SMs its kernels hold: compute overlapped by a collective for
t seconds takes `Device.comm_sm_fraction` x t longer (NCCL's CTAs hold their SMs exclusively;
the constants and their sources are in catalog.py), the `contention_s` of a prediction. (The
0.1-of-hidden-time "interference" term that was here rested on no measurement and is gone;
contention for memory bandwidth is not modelled.)

On the `cpu` machine (N ranks time-sharing this host's cores) the rates come from its probe
(`Machine.calibration(N)`, see fourfold.plan.host_probe): GEMM, memory and per-op rates with all N
ranks busy, each collective call a fitted latency + ring volume x seconds per byte of its group
size, and overlap scaled down to what spare cores can hide (none when N >= cores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fourfold.config import ModelConfig, TrainConfig
from fourfold.data.balance import SequenceCost
from fourfold.models.llama import flops_per_token
from fourfold.parallel.embedding import uses_blocked_loss
from fourfold.parallel.grid import AXES, GridShape
from fourfold.parallel.linear import split_rows
from fourfold.plan.catalog import Machine, ring_volume
from fourfold.plan.host_probe import HostCalibration
from fourfold.plan.memory import Precision
from fourfold.plan.methods.base import MethodCost, spec_of
from fourfold.plan.schedule import Collective, block_linears, collective_schedule


@dataclass(frozen=True)
class Overlap:
    """Which of the engine's overlaps are on (the fields of ParallelConfig of the same names)."""

    overlap_input_grad: bool = True
    overlap_weight_grad: bool = True
    prefetch_weights: bool = True
    overlap_data_grad: bool = True
    overlap_forward: bool = False


@dataclass
class StepPrediction:
    step_s: float
    compute_s: float
    comm_s: dict[str, float]  # per axis, total collective time per step
    hidden_s: dict[str, float]  # per axis, the part hidden under compute
    comm_bytes: dict[str, int]  # per axis, per rank, as the ledger counts
    tokens_per_s: float
    mfu: float  # model FLOPs (no recomputation) / peak: what the planner ranks by, via step_s
    flops_per_step: float  # model FLOPs of the whole job per step
    hfu: float = 0.0  # hardware FLOPs (with the recomputed forward of checkpointing) / peak
    contention_s: float = 0.0  # compute slowed by the SMs hidden collectives hold
    notes: list[str] = field(default_factory=list)


def hardware_flops_per_token(model: ModelConfig, seq_len: int,
                             activation_checkpointing: bool) -> float:
    """FLOPs per token a device really runs: the model FLOPs (`flops_per_token`) plus, under
    activation checkpointing, the blocks' forward once more (2 FLOPs per block weight and the
    attention forward, a third of its 12 * L * d * s); the embedding, final norm and output
    layer are not recomputed (as in `collective_schedule`). With it on, HFU = MFU * this /
    flops_per_token: the trainer logs `hfu` beside `mfu` this way."""
    model_flops = flops_per_token(model, seq_len)
    if not activation_checkpointing:
        return model_flops
    d, kv = model.dim, model.n_kv_heads * model.head_dim
    block_weights = model.n_layers * (2 * d * d + 2 * d * kv + 3 * d * model.ffn_dim)
    return model_flops + 2.0 * block_weights + 4.0 * model.n_layers * d * seq_len


@dataclass(frozen=True)
class Rates:
    """What one rank gets: GEMM FLOP/s (large GEMMs), memory bytes/s, seconds per op."""

    flops: float
    bytes_per_s: float
    op_overhead_s: float
    gemm_half_dim: float
    elementwise_bytes_per_s: float  # the blocks' element-wise work
    loss_s_per_logit: float  # cross-entropy forward + backward, per logit
    # causal attention per sequence x head x seq^2 x head_dim, forward and forward + backward
    # (probed on the cpu machine; 0 elsewhere: flash attention at the GEMM rate)
    attention_forward_s_per_unit: float = 0.0
    attention_s_per_unit: float = 0.0
    noise_s_per_element: float = 0.0  # mezo / es noise, probed on the cpu machine (0: modelled)


def _rates(machine: Machine, dtype: str, world_size: int,
           calibration: HostCalibration | None) -> Rates:
    dev = machine.device
    if calibration is not None:
        # every rank time-shares the host's cores and memory: the probe ran them all at once
        copy = calibration.bytes_per_s_per_rank
        return Rates(calibration.flops_per_rank, copy, calibration.op_overhead_s,
                      dev.gemm_half_dim, calibration.elementwise_bytes_per_s or copy,
                      calibration.loss_s_per_logit or _LOSS_PASS_BYTES / copy,
                      calibration.attention_forward_s_per_unit, calibration.attention_s_per_unit,
                      calibration.noise_s_per_element)
    hbm = machine.hbm_bytes_per_s_per_rank(world_size)
    # on a GPU element-wise kernels and the loss are bound by memory bandwidth
    return Rates(machine.peak_flops_per_rank(dtype, world_size) * dev.gemm_efficiency, hbm,
                  dev.op_overhead_us * 1e-6, dev.gemm_half_dim, hbm, _LOSS_PASS_BYTES / hbm)


# the loss's memory traffic per fp32 logit: 3 passes forward, 3 backward
_LOSS_PASS_BYTES = 2 * 3 * 4

# A block's element-wise work (norms, RoPE, SwiGLU, residual adds) in elements read + written
# per token, per width: the model dim (split over x), the ffn width and q + k + v (split over
# y). From torch.profiler's count of the engine's non-GEMM, non-attention ops over one step of
# 2 and 4 blocks at two ffn widths (bench/elementwise_count.py; with kv = dim it reads forward
# 28 dim + 5 ffn, forward + backward 97 dim + 29 ffn, at dim 128 and 256 alike; these give
# 24 + 5 and 95 + 29). The backward is about 2.5x the forward, not 2x: SwiGLU's backward
# recomputes silu and runs its sigmoid derivative, RMSNorm's reads its input and the gradient
# twice. tests/test_plan.py holds these against the profile.
ELEMENTWISE_PER_TOKEN = {"forward": {"dim": 12, "ffn": 5, "qkv": 4},
                         "backward": {"dim": 35, "ffn": 24, "qkv": 12}}


def gemm_seconds(m: int, n: int, k: int, rates: Rates, elem_bytes: int, batch: int = 1) -> float:
    if min(m, n, k) <= 0:
        return 0.0
    h = rates.gemm_half_dim
    shape_eff = (m / (m + h)) * (n / (n + h)) * (k / (k + h))
    flop_time = 2.0 * m * n * k / (rates.flops * shape_eff)
    memory_time = (m * k + k * n + m * n) * elem_bytes / rates.bytes_per_s
    return batch * max(flop_time, memory_time)


def collective_seconds(c: Collective, shape: GridShape, machine: Machine,
                       calibration: HostCalibration | None = None) -> float:
    """One call of a collective over its axis: on the cpu machine the probe's fitted latency +
    ring volume x seconds per byte for its group size; elsewhere as NCCL times it.

    NCCL (and RCCL) estimate each call's time per algorithm as latency + bytes / bandwidth and
    run the fastest (NCCL_ALGO's documented default: automatic choice; the model lives in
    NCCL's tuning code). Ring: 2(p-1) latency steps for an all-reduce, p-1 for the others, and
    the ring volume over the group's effective bandwidth. All-reduce also has the double
    binary tree (NCCL 2.4, "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA
    blog, 2019): latency logarithmic in p, 2 ceil(log2 p) steps (reduce up, broadcast down),
    and each rank sends the whole buffer up and receives it down (2 x nbytes over the same
    bandwidth). All-gather and reduce-scatter stay rings (PAT, NCCL >= 2.23's logarithmic
    algorithm for one rank per node, is not modelled)."""
    p = c.group_size or getattr(shape, c.axis)
    if calibration is not None:
        return calibration.collective_seconds(c.op, p, c.nbytes)
    bw = machine.bandwidth_gbps(p, 1 if c.group_size else shape.stride(c.axis)) * 1e9
    latency = machine.network.latency_us * 1e-6
    steps = 2 * (p - 1) if c.op == "all_reduce" else p - 1
    ring = ring_volume(c.op, p, c.nbytes) / bw + steps * latency
    if c.op != "all_reduce" or p <= 2:
        return ring
    tree = 2 * c.nbytes / bw + 2 * math.ceil(math.log2(p)) * latency
    return min(ring, tree)


@dataclass(frozen=True)
class _Compute:
    forward: float  # one micro-step, blocks + embedding + output layer + loss
    backward: float  # one micro-step, without recomputation
    weight_grad: float  # the dW GEMMs inside backward
    recompute: float  # forward of the blocks again (activation checkpointing)
    forward_gemm: float  # the forward GEMMs of one micro-step (blocks and output layer)
    recompute_gemm: float  # the blocks' forward GEMMs again


def _compute_times(model: ModelConfig, shape: GridShape, n: int, seq_len: int, rates: Rates,
                   precision: Precision, forward_split: bool = False,
                   blocked_loss: bool = False) -> _Compute:
    gx, gy = shape.x, shape.y
    eb = precision.act_bytes
    # overlap_forward runs each forward GEMM as two over the token halves: smaller GEMMs
    # (lower shape efficiency) and one more launch each, the price of the hidden all-reduce
    halves = [h for h in split_rows(n) if h > 0] if forward_split else [n]

    def forward_gemm(out_f: int, in_f: int) -> float:
        return sum(gemm_seconds(h, out_f, in_f, rates, eb) for h in halves)

    fwd = dgrad = wgrad = 0.0
    for lin in block_linears(model):
        out_l, in_l = ((lin.out_features // gx, lin.in_features // gy) if lin.transposed
                       else (lin.out_features // gy, lin.in_features // gx))
        fwd += forward_gemm(out_l, in_l)
        dgrad += gemm_seconds(n, in_l, out_l, rates, eb)
        wgrad += gemm_seconds(out_l, in_l, n, rates, eb)
    # attention: heads split over y (replicated over x); causal, so half of the score matrix
    heads = max(1, model.n_heads // gy)
    seqs = max(1, n // seq_len)
    if rates.attention_s_per_unit > 0.0:  # the kernel's own probed rate
        units = seqs * heads * seq_len * seq_len * model.head_dim
        attn_fwd = units * rates.attention_forward_s_per_unit
        attn_bwd = units * max(rates.attention_s_per_unit - rates.attention_forward_s_per_unit,
                               rates.attention_forward_s_per_unit)
    else:  # two half-size (causal) GEMMs, scores and weighted sum; backward twice that
        attn_fwd = gemm_seconds(seq_len, seq_len, model.head_dim, rates, eb, batch=seqs * heads)
        attn_bwd = 2 * attn_fwd
    # element-wise work (norms, RoPE, SwiGLU, residual adds): ELEMENTWISE_PER_TOKEN
    kv = model.n_kv_heads * model.head_dim
    widths = {"dim": model.dim // gx, "ffn": model.ffn_dim // gy,
              "qkv": (model.dim + 2 * kv) // gy}

    def elementwise(counts: dict[str, int]) -> float:
        return n * eb * sum(c * widths[k] for k, c in counts.items()) / \
            rates.elementwise_bytes_per_s

    elem = elementwise(ELEMENTWISE_PER_TOKEN["forward"])
    elem_bwd = elementwise(ELEMENTWISE_PER_TOKEN["backward"])
    # per-kernel overhead: about 25 kernels in a block's forward, twice that in backward
    launch = rates.op_overhead_s
    # the split adds a GEMM and an all-reduce launch to each of the block's 4 fused units
    block_fwd = fwd + attn_fwd + elem + (33 if forward_split else 25) * launch
    block_bwd = dgrad + wgrad + attn_bwd + elem_bwd + 50 * launch
    L = model.n_layers
    vocab_l, d_l = model.vocab_size // gy, model.dim // gx
    out_fwd = forward_gemm(vocab_l, d_l)
    out_dgrad = gemm_seconds(n, d_l, vocab_l, rates, eb)
    out_wgrad = gemm_seconds(vocab_l, d_l, n, rates, eb)
    loss = n * vocab_l * rates.loss_s_per_logit / 2  # forward; the same again in backward
    # the blocked loss (parallel.output_loss) makes the logits again in backward
    again = out_fwd if blocked_loss else 0.0
    return _Compute(forward=L * block_fwd + out_fwd + loss + 10 * launch,
                    backward=L * block_bwd + out_dgrad + out_wgrad + again + loss + 20 * launch,
                    weight_grad=L * wgrad + out_wgrad, recompute=L * block_fwd,
                    forward_gemm=L * fwd + out_fwd, recompute_gemm=L * fwd)


def method_cost(model: ModelConfig, shape: GridShape, train: TrainConfig | None, rates: Rates,
                precision: Precision) -> MethodCost:
    """The step of train.optimizer (None: AdamW) as forwards, passes and update work (its
    planner model, plan/methods)."""
    return spec_of(train).planner_model().cost(model, shape, train or TrainConfig(), rates,
                                               precision)


def sequence_cost(model: ModelConfig, seq_len: int, machine: Machine | None = None,
                  dtype: str = "float32") -> SequenceCost:
    """What a packed row of seq_len positions costs a rank, for the loader to balance its
    ranks (data/balance.py): seconds per position (the GEMMs, element-wise work and loss of a
    forward and backward) and per squared document length (causal attention), as this model
    predicts them on one rank of `machine`; without one, their FLOPs (the same law at one
    rate). Read from the step's prediction at two document lengths, s and s/2 (the attention
    the difference scales with s^2, the rest not)."""
    shape = GridShape(data=1, z=1, y=1, x=1)
    precision = Precision.of(dtype)
    if machine is None:
        d, L = model.dim, model.n_layers
        attention_flops = 12.0 * L * d / 2  # forward + backward, causal: half the scores
        return SequenceCost(token=flops_per_token(model, 0), square=attention_flops)
    rates = _rates(machine, precision.name, 1, None)  # no host probe: ratios are what count
    half = max(1, seq_len // 2)

    def step(length: int) -> float:
        comp = _compute_times(model, shape, seq_len, length, rates, precision)
        return comp.forward + comp.backward

    whole, halves = step(seq_len), step(half)
    # attention of one document of s against two of s/2: a (s^2 - s^2 / 2)
    square = max(whole - halves, 0.0) / (seq_len * seq_len - 2 * half * half)
    token = max(whole - square * seq_len * seq_len, 0.0) / seq_len
    return SequenceCost(token=token, square=square)



def method_collectives(model: ModelConfig, shape: GridShape, train: TrainConfig | None
                       ) -> list[Collective]:
    """A training method's own collectives in one step, per rank, beyond the model's schedule
    (its planner model's; None: AdamW, which has none)."""
    return spec_of(train).planner_model().collectives(model, shape, train or TrainConfig())


def predict_step(model: ModelConfig, shape: GridShape, global_batch: int, seq_len: int,
                 grad_accum: int, activation_checkpointing: bool, machine: Machine,
                 precision: Precision, overlap: Overlap = Overlap(),
                 output_loss: str = "auto", train: TrainConfig | None = None
                 ) -> StepPrediction:
    """Predicted time of one optimizer step; the batch is split over the method's batch axes
    (data and z; es: z), then into `grad_accum` micro-steps. `output_loss`:
    parallel.output_loss. `train`: the step of its train.optimizer (`method_cost`; None:
    AdamW). A forward-only method (mezo, es) runs its forwards without recomputation and issues
    only the forward's collectives (its scalar losses are not counted)."""
    world = shape.size
    # the batch is split over the method's batch axes (data and z; es: z alone, each data
    # replica evaluating its members on the whole batch)
    spec = spec_of(train)
    n = global_batch // spec.batch_shards(shape) // grad_accum * seq_len  # per rank, micro-step
    calibration = machine.calibration(world)
    rates = _rates(machine, precision.name, world, calibration)
    blocked = uses_blocked_loss(output_loss)
    comp = _compute_times(model, shape, n, seq_len, rates, precision, overlap.overlap_forward,
                          blocked)
    cost = method_cost(model, shape, train, rates, precision)
    # a forward-only method recomputes nothing, so its forwards issue each block's forward
    # collectives once (with checkpointing the schedule counts them twice, for the recompute)
    schedule = collective_schedule(model, shape, n, grad_accum,
                                   activation_checkpointing and not cost.forwards,
                                   precision.act_bytes, precision.weight_bytes,
                                   precision.reduce_bytes, precision.residual_bytes,
                                   overlap.overlap_forward, output_loss=output_loss)
    schedule = schedule + method_collectives(model, shape, train)
    # the step's token count, summed over the batch axes: over every rank at once (booked on
    # no axis) for data and z together, else one float64 all-reduce on each axis that splits
    if tuple(spec.batch_axes) != ("data", "z"):
        schedule += [Collective(a, "all_reduce", 8, 1, "step_method") for a in spec.batch_axes
                     if getattr(shape, a) > 1]

    def runs(phase: str) -> int:
        """How many times the step issues the schedule's collectives of `phase`."""
        if phase == "step_method":  # the method's own, counted per step
            return 1
        if cost.forwards:
            return cost.forwards if phase.startswith("fwd") else 0
        return cost.passes

    by_phase: dict[str, dict[str, float]] = {}
    comm_bytes = {a: 0 for a in AXES}
    for c in schedule:
        calls = c.calls * runs(c.phase)
        t = calls * collective_seconds(c, shape, machine, calibration) / c.every
        by_phase.setdefault(c.phase, {a: 0.0 for a in AXES})[c.axis] += t
        comm_bytes[c.axis] += c.nbytes * calls // c.every

    def phase(name: str) -> dict[str, float]:
        return by_phase.get(name, {a: 0.0 for a in AXES})

    m = grad_accum
    recompute = comp.recompute if activation_checkpointing else 0.0
    if cost.forwards:  # no backward, so nothing to recompute
        recompute = 0.0
        fwd_window, bwd_window = cost.forwards * m * comp.forward, 0.0
    else:
        fwd_window = cost.passes * m * comp.forward
        bwd_window = cost.passes * m * (comp.backward + recompute)
    # the first layer's gather of each pass has nothing to hide under
    units = model.n_layers + 2
    share = (units - 1) / units
    hidden = {a: 0.0 for a in AXES}
    overlap_efficiency = calibration.overlap_efficiency if calibration is not None else 1.0

    def hide(times: dict[str, float], window: float, fraction: float) -> float:
        """Hide up to `fraction` of the times under `window`, shared in proportion."""
        total = sum(times.values())
        if total <= 0.0 or window <= 0.0:
            return 0.0
        hidden_total = min(total * fraction * overlap_efficiency, window)
        for a, t in times.items():
            hidden[a] += hidden_total * t / total
        return hidden_total

    if overlap.prefetch_weights:
        hide(phase("fwd_gather"), fwd_window, share)
    # overlap_forward: a first half's output all-reduce runs under the second half's GEMM
    split_window = max(cost.forwards, cost.passes) * m * (
        comp.forward_gemm + (comp.recompute_gemm if recompute else 0.0)) / 2
    hide(phase("fwd_split"), split_window, 1.0)
    # backward z traffic (gathers and dW reduce-scatters) shares the z links and backward window
    z_backward = {a: (phase("bwd_gather")[a] if overlap.prefetch_weights else 0.0)
                  + (phase("bwd_weight")[a] if overlap.overlap_weight_grad else 0.0) for a in AXES}
    hide(z_backward, bwd_window, share)
    if overlap.overlap_input_grad:
        hide(phase("bwd_input"), cost.passes * m * comp.weight_grad, 1.0)
    if overlap.overlap_data_grad:
        hide(phase("step_data"), cost.passes * (comp.backward + recompute), share)

    comm = {a: sum(p[a] for p in by_phase.values()) for a in AXES}
    # the method's own work (method_cost: its planner model's)
    compute = fwd_window + bwd_window + cost.update_s
    # while a hidden collective runs, its kernels hold comm_sm_fraction of the SMs: the compute
    # under it runs that much slower (W of work overlapped for t takes W + f t), summed over
    # collectives, which each hold their own channels even when they run at the same time
    contention = sum(hidden.values()) * machine.device.comm_sm_fraction
    step = compute + contention + sum(comm[a] - hidden[a] for a in AXES)
    tokens = global_batch * seq_len
    flops = flops_per_token(model, seq_len) * tokens
    hardware = hardware_flops_per_token(model, seq_len, activation_checkpointing) * tokens
    if cost.forwards:  # a forward is a third of the model FLOPs (2 of 6 per weight, token)
        flops = hardware = cost.forwards * flops / 3
    else:
        hardware *= cost.passes
    peak = machine.job_peak_flops(precision.name, world)
    return StepPrediction(step_s=step, compute_s=compute, comm_s=comm, hidden_s=hidden,
                          comm_bytes=comm_bytes, tokens_per_s=tokens / step,
                          mfu=flops / (step * peak), flops_per_step=flops,
                          hfu=hardware / (step * peak), contention_s=contention)
