"""Configuration search: every grid data*z*y*x = N, the fastest micro-batch and activation
checkpointing setting that fits in memory for each, ranked by predicted step time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fourfold.config import PRESETS, ModelConfig, TrainConfig, model_config
from fourfold.intmath import divisors
from fourfold.methods import method_names, method_spec
from fourfold.parallel.embedding import resolve_output_loss
from fourfold.parallel.grid import AXES, RANK_ORDER, GridShape
from fourfold.plan.errors import PlanError
from fourfold.intmath import GIB
from fourfold.plan.catalog import Machine
from fourfold.plan.memory import (MemoryBreakdown, Precision, predict_memory,
                                  predict_method_memory, predicted_memory)
from fourfold.plan.methods.base import method_model, spec_of
from fourfold.plan.perf import Overlap, StepPrediction, predict_step

if TYPE_CHECKING:
    import torch

    from fourfold.config import Config


@dataclass
class Candidate:
    shape: GridShape
    micro_batch: int  # sequences per (data, z) shard per micro-step
    grad_accum: int
    activation_checkpointing: bool
    prediction: StepPrediction
    memory: MemoryBreakdown
    usable_bytes: float
    reduce_dtype: str = "float32"  # parallel.reduce_dtype this prediction assumes
    overlap_forward: bool = False  # parallel.overlap_forward this prediction assumes

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def oom_gib(self) -> float:
        """How far over the usable memory, in GiB (0 when it fits)."""
        return max(0.0, (self.memory.total - self.usable_bytes) / GIB)

    def to_json(self) -> dict:
        p = self.prediction
        return {
            "grid": {a: getattr(self.shape, a) for a in RANK_ORDER},
            "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
            "activation_checkpointing": self.activation_checkpointing,
            "reduce_dtype": self.reduce_dtype, "overlap_forward": self.overlap_forward,
            "step_s": p.step_s, "compute_s": p.compute_s, "contention_s": p.contention_s,
            "tokens_per_s": p.tokens_per_s,
            "mfu": p.mfu, "hfu": p.hfu,
            "comm_s": dict(p.comm_s), "comm_hidden_s": dict(p.hidden_s),
            "comm_bytes": dict(p.comm_bytes),
            "memory_gib": self.memory.total / GIB,
            "memory_breakdown_gib": {k: getattr(self.memory, k) / GIB for k in
                                     ("params", "grads", "optimizer", "activations",
                                      "gathered_weights", "logits")},
            "usable_memory_gib": self.usable_bytes / GIB,
            "fits": self.fits, "oom_gib": self.oom_gib,
        }


@dataclass
class Plan:
    model: ModelConfig
    machine: Machine
    world_size: int
    global_batch: int
    seq_len: int
    precision: Precision
    candidates: list[Candidate]  # best first: those that fit by time, then the rest by memory
    rejected: list[tuple[GridShape, str]] = field(default_factory=list)
    optimizer: str = "adamw"  # train.optimizer the memory column was planned for
    # what the search was given beyond the above (for `why_nothing_fits`)
    train: TrainConfig | None = None
    grad_accum: int | None = None  # fixed by the caller; None: searched
    checkpointing: tuple[bool, ...] = (False, True)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def time_note(self) -> str | None:
        """What the step-time column is for this optimizer (None for AdamW's own step)."""
        return method_model(self.optimizer).time_note

    def why_nothing_fits(self) -> str:
        """When no grid fits, one line: why, and what would make one fit (the batch,
        accumulation, activation checkpointing, more GPUs, a leaner optimizer); "" when one
        fits. Each fix offered is checked: the job with it fits on some grid."""
        return "" if self.best.fits else nothing_fits_advice(self)


def batch_axes(optimizer: str = "adamw") -> tuple[str, ...]:
    """The grid axes a step's batch is split over under `optimizer`."""
    return method_spec(optimizer).batch_axes


def batch_split(shape: GridShape, optimizer: str = "adamw") -> int:
    """How many shards a step's batch is split into on `shape` under `optimizer`."""
    return method_spec(optimizer).batch_shards(shape)


_SHAPE_FIELDS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                 "tie_embeddings", "bias")


def model_label(model: ModelConfig) -> str:
    """The model's preset name when its shape is that preset's, else "custom" (a config file
    that names a preset and overrides its shape, or names none, is not that preset)."""
    if model.preset in PRESETS:
        preset = model_config(model.preset)
        if all(getattr(model, f) == getattr(preset, f) for f in _SHAPE_FIELDS):
            return model.preset
    return "custom"


def grid_shapes(world_size: int) -> list[GridShape]:
    """Every (data, z, y, x) with data*z*y*x = world_size."""
    if world_size < 1:
        raise PlanError(f"GPU count {world_size}: must be at least 1")
    sizes = divisors(world_size)
    shapes = []
    for x in sizes:
        for y in sizes:
            if (world_size // x) % y:
                continue
            for z in sizes:
                if (world_size // (x * y)) % z:
                    continue
                shapes.append(GridShape(data=world_size // (x * y * z), z=z, y=y, x=x))
    return shapes


def grid_problem(model: ModelConfig, shape: GridShape, global_batch: int,
                 optimizer: str = "adamw") -> str | None:
    """Why this grid cannot run this model and batch, or None.

    Normal layers split out over y then z and in over x; transposed layers (o, down) split out
    over x then z and in over y; attention needs whole heads per y rank; the batch is split over
    data and z (over z alone under es, whose replicas each see the whole batch)."""
    gx, gy, gz = shape.x, shape.y, shape.z
    split_axes = "*".join(batch_axes(optimizer))
    kv = model.n_kv_heads * model.head_dim
    checks = [
        (model.dim, gx * gz, "model.dim", "x*z"), (model.dim, gy, "model.dim", "y"),
        (model.ffn_dim, gy * gz, "model.ffn_dim", "y*z"),
        (model.n_heads, gy, "model.n_heads", "y"), (model.n_kv_heads, gy, "model.n_kv_heads", "y"),
        (kv, gy * gz, "kv dim", "y*z"), (model.dim, gy * gz, "model.dim", "y*z"),
        (model.vocab_size, gy * gz, "model.vocab_size", "y*z"),
        (global_batch, batch_split(shape, optimizer), "batch", split_axes),
    ]
    for value, parts, what, axes in checks:
        if value % parts:
            return f"{what} = {value} not divisible by {axes} = {parts}"
    return None


def best_for_grid(model: ModelConfig, shape: GridShape, global_batch: int, seq_len: int,
                  machine: Machine, precision: Precision, overlap: Overlap,
                  checkpointing: tuple[bool, ...] = (False, True),
                  grad_accum: int | None = None, reduce_dtypes: tuple[str, ...] | None = None,
                  overlap_forward: tuple[bool, ...] | None = None,
                  train: "TrainConfig | None" = None) -> Candidate:
    """For one grid, the fastest (micro-batch, activation checkpointing, reduce dtype, forward
    split) that fits; when none fits, the one that needs least memory. `reduce_dtypes` and
    `overlap_forward` are the settings of parallel.reduce_dtype / parallel.overlap_forward to
    consider (None: the precision's own reduce dtype, `overlap`'s own split); neither changes
    the memory model's peak, so they are chosen by time alone. `train`: the memory is that of
    its train.optimizer (predict_method_memory); None: AdamW's."""
    world = shape.size
    usable = machine.usable_memory_bytes(world)
    spec = spec_of(train)
    local_batch = global_batch // batch_split(shape, spec.name)
    if not spec.accumulates:
        grad_accum = 1
    micro_options = ([local_batch // grad_accum] if grad_accum else
                     divisors(local_batch)[::-1])
    wires = [(_reduce_dtype(precision), precision)] if reduce_dtypes is None else \
        [(r, dataclasses.replace(precision, reduce_bytes=_REDUCE_BYTES[r]))
         for r in reduce_dtypes]
    splits = [dataclasses.replace(overlap, overlap_forward=f)
              for f in ((overlap.overlap_forward,) if overlap_forward is None
                        else overlap_forward)]

    # A rank's share of the step: under es every data replica runs the whole batch, so the
    # time model (which splits its batch over data and z) is given `copies` times the batch and
    # its tokens/s is divided back to the job's real tokens (its FLOPs are the forwards every
    # replica runs: method_cost counts a replica's members).
    copies = local_batch * shape.data * shape.z // global_batch
    # parallel.output_loss at its default, as the method's run resolves it
    loss_mode = resolve_output_loss("auto", spec.blocked_loss)

    def step(accum: int, ac: bool, wire: Precision, split: Overlap) -> StepPrediction:
        p = predict_step(model, shape, global_batch * copies, seq_len, accum, ac, machine, wire,
                         split, output_loss=loss_mode, train=train)
        if copies == 1:
            return p
        return dataclasses.replace(p, tokens_per_s=p.tokens_per_s / copies)

    def candidates(micro: int, ac: bool, mem: MemoryBreakdown) -> list[Candidate]:
        accum = local_batch // micro
        return [Candidate(shape, micro, accum, ac, step(accum, ac, wire, split), mem, usable,
                          reduce_dtype, split.overlap_forward)
                for reduce_dtype, wire in wires for split in splits]

    fitting: list[Candidate] = []
    smallest: tuple[int, bool, MemoryBreakdown] | None = None
    for ac in checkpointing:
        for micro in micro_options:  # largest first: bigger GEMMs, fewer repeated gathers
            accum = local_batch // micro
            mem = candidate_memory(model, shape, micro, accum, ac, seq_len, precision,
                                   loss_mode, train)
            if smallest is None or mem.total < smallest[2].total:
                smallest = (micro, ac, mem)
            if mem.total <= usable:
                fitting.extend(candidates(micro, ac, mem))
                break
    if not fitting:
        assert smallest is not None
        fitting = candidates(*smallest)
    return min(fitting, key=lambda c: c.prediction.step_s)


def candidate_memory(model: ModelConfig, shape: GridShape, micro_batch: int, grad_accum: int,
                     activation_checkpointing: bool, seq_len: int, precision: Precision,
                     output_loss: str, train: TrainConfig | None) -> MemoryBreakdown:
    """A rank's peak running micro-batches of `micro_batch` sequences, `grad_accum` of them a
    step: AdamW's (predict_memory), or with `train`, its method's gradients and state as this
    micro-batch accumulates them."""
    mem = predict_memory(model, shape, micro_batch * seq_len, activation_checkpointing,
                         precision, output_loss=output_loss, grad_accum=grad_accum)
    if train is None:
        return mem
    method = dataclasses.replace(train, grad_accum=grad_accum)
    return predict_method_memory(mem, model, shape, method, precision, output_loss)


_REDUCE_BYTES = {"float32": 4, "bfloat16": 2}
REDUCE_DTYPES: tuple[str, ...] = tuple(_REDUCE_BYTES)


def _reduce_dtype(precision: Precision) -> str:
    return "bfloat16" if precision.reduce_bytes == 2 else "float32"


def plan(model: ModelConfig, world_size: int, machine: Machine, global_batch: int, seq_len: int,
         dtype: str | Precision = "bfloat16", overlap: Overlap = Overlap(),
         checkpointing: tuple[bool, ...] = (False, True), grad_accum: int | None = None,
         reduce_dtypes: tuple[str, ...] | None = None,
         overlap_forward: tuple[bool, ...] | None = None,
         train: "TrainConfig | None" = None) -> Plan:
    """Predict every grid for this job and rank them (fitting ones first, each by step time).
    `dtype` is a name (`Precision.of`) or a Precision (e.g. another wire dtype);
    `reduce_dtypes` / `overlap_forward`: the parallel.reduce_dtype / overlap_forward settings
    the search may pick from (None: the precision's reduce dtype, `overlap`'s split);
    `train`: plan the memory of its train.optimizer (with its [train.method] options),
    None: AdamW's."""
    optimizer = "adamw" if train is None else train.optimizer
    if optimizer not in method_names():
        raise PlanError(f"--optimizer {optimizer!r}: choose one of {', '.join(method_names())}")
    if not method_spec(optimizer).accumulates and grad_accum not in (None, 1):
        raise PlanError(f"--grad-accum {grad_accum}: {optimizer} updates each weight during "
                        "backward, so it cannot accumulate; use 1")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"--gpus {world_size}: the GPU count must be a positive integer")
    if global_batch < 1:
        raise PlanError(f"--global-batch {global_batch}: must be at least 1 sequence")
    if seq_len < 1 or seq_len > model.max_seq_len:
        raise PlanError(f"--seq {seq_len}: must be between 1 and the model's max_seq_len "
                        f"{model.max_seq_len}")
    if grad_accum is not None and grad_accum < 1:
        raise PlanError(f"--grad-accum {grad_accum}: must be at least 1")
    for r in reduce_dtypes or ():
        if r not in _REDUCE_BYTES:
            raise PlanError(f"reduce dtype {r!r}: choose one of {', '.join(REDUCE_DTYPES)}")
    if reduce_dtypes == () or overlap_forward == ():
        raise PlanError("reduce_dtypes / overlap_forward: give at least one setting (or None)")
    precision = dtype if isinstance(dtype, Precision) else Precision.of(dtype)
    candidates, rejected = [], []
    for shape in grid_shapes(world_size):
        problem = grid_problem(model, shape, global_batch, optimizer)
        if problem is None and grad_accum is not None and \
                (global_batch // batch_split(shape, optimizer)) % grad_accum:
            problem = f"grad_accum {grad_accum} does not divide the per-shard batch"
        if problem:
            rejected.append((shape, problem))
            continue
        candidates.append(best_for_grid(model, shape, global_batch, seq_len, machine, precision,
                                        overlap, checkpointing, grad_accum, reduce_dtypes,
                                        overlap_forward, train))
    if not candidates:
        raise PlanError(_no_grid_message(model, world_size, global_batch, rejected, optimizer))
    # those that fit by time; the rest by how much memory they need, the closest miss first
    candidates.sort(key=lambda c: (0, c.prediction.step_s) if c.fits else (1, c.memory.total))
    return Plan(model, machine, world_size, global_batch, seq_len, precision, candidates,
                rejected, optimizer, train, grad_accum, checkpointing)


# Training methods from the most state per parameter to the least, for the advice that a leaner
# one fits (es is left out: its population changes what a step is).
LEANER_ORDER: tuple[str, ...] = ("adamw", "galore", "blockllm", "adalomo", "lomo", "mezo")
# How far the advice looks for a GPU count that fits: up to this many times the job's.
_ADVICE_GPU_FACTOR = 64


def leanest_fits(model: ModelConfig, world_size: int, global_batch: int, seq_len: int,
                 machine: Machine, precision: Precision, train: TrainConfig | None,
                 grad_accum: int | None = None,
                 checkpointing: tuple[bool, ...] = (False, True)) -> bool:
    """Whether some grid of `world_size` ranks holds this job at its leanest: each of
    `checkpointing`, the smallest micro-batch its method and a fixed `grad_accum` allow. Memory
    only (no step times), so the advice can ask it of many variants of a job. Only grids
    without data-parallel replicas are tried: moving a grid's data ranks onto z splits the
    batch alike and shards the weights and states too, so the leanest grids have data = 1."""
    optimizer = "adamw" if train is None else train.optimizer
    usable = machine.usable_memory_bytes(world_size)
    loss_mode = resolve_output_loss("auto", method_spec(optimizer).blocked_loss)
    for shape in grid_shapes(world_size):
        if shape.data > 1 or grid_problem(model, shape, global_batch, optimizer) is not None:
            continue
        local_batch = global_batch // batch_split(shape, optimizer)
        accum = (grad_accum or local_batch) if method_spec(optimizer).accumulates else 1
        if local_batch % accum:
            continue
        if any(candidate_memory(model, shape, local_batch // accum, accum, ac, seq_len, precision,
                                loss_mode, train).total <= usable for ac in checkpointing):
            return True
    return False


def _either(options: list[str]) -> str:
    return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"


def nothing_fits_advice(result: Plan) -> str:
    """Why no grid of `result` fits (from its leanest candidate) and the fixes that would make
    one fit, each checked by `leanest_fits`, in one line."""
    best, optimizer = result.best, result.optimizer
    accumulates = method_spec(optimizer).accumulates
    model, world = result.model, result.world_size
    batch, seq = result.global_batch, result.seq_len
    mem, usable = best.memory, best.usable_bytes / GIB
    need = f"{mem.total / GIB:.1f} GiB per rank on the leanest grid ({best.shape}), " \
           f"{usable:.1f} GiB usable"

    def fits(world: int = world, global_batch: int = batch,
             train: TrainConfig | None = result.train,
             grad_accum: int | None = result.grad_accum,
             checkpointing: tuple[bool, ...] = result.checkpointing) -> bool:
        return leanest_fits(model, world, global_batch, seq, result.machine, result.precision,
                            train, grad_accum, checkpointing)

    state = (mem.params + mem.grads + mem.optimizer) / GIB
    micro = f"{best.micro_batch} sequence{'s' if best.micro_batch > 1 else ''}"
    if not accumulates and best.micro_batch > 1:
        why = (f"{optimizer} updates each weight inside backward, so it cannot accumulate "
               f"micro-batches: the batch of {batch} x {seq} tokens runs whole, {micro} a "
               f"rank, {need}")
    elif result.grad_accum is not None and best.micro_batch > 1:
        why = f"--grad-accum {result.grad_accum} makes micro-batches of {micro} a rank, {need}"
    elif state > usable:
        held = ["the weights"] + (["gradients"] if mem.grads else []) + \
            ([f"{optimizer}'s state"] if mem.optimizer else [])
        why = (f"{', '.join(held[:-1]) + ' and ' if len(held) > 1 else ''}{held[-1]} alone "
               f"take {state:.1f} GiB per rank on the leanest grid ({best.shape}), "
               f"{usable:.1f} GiB usable")
    else:
        why = (f"at a micro-batch of {micro}, activation checkpointing "
               f"{'on' if best.activation_checkpointing else 'off'}, a rank needs {need}")
    fixes = []  # the batch and its micro-batches first: they change nothing else
    if result.grad_accum is not None and accumulates and fits(grad_accum=None):
        fixes.append("leave out --grad-accum (the search accumulates)")
    if not accumulates or result.grad_accum is not None:
        smaller = next((b for b in (batch >> k for k in range(1, batch.bit_length()))
                        if fits(global_batch=b)), None)
        if smaller is not None:
            fixes.append(f"--global-batch {smaller}")
    batch_fixed = bool(fixes)
    if True not in result.checkpointing and fits(checkpointing=(True,)):
        fixes.append("--activation-checkpointing on")
    if not result.machine.device.shared_host:  # ranks on one host share its memory
        more = next((world << k for k in range(1, _ADVICE_GPU_FACTOR.bit_length())
                     if fits(world=world << k)), None)
        if more is not None:
            fixes.append(f"{more} GPUs")
    if not batch_fixed and optimizer in LEANER_ORDER:  # the state is what does not fit
        for name in LEANER_ORDER[LEANER_ORDER.index(optimizer) + 1:]:
            lean = dataclasses.replace(result.train or TrainConfig(), optimizer=name)
            accum = result.grad_accum if method_spec(name).accumulates else None
            if fits(train=lean, grad_accum=accum):
                fixes.append(f"--optimizer {name}")
                break
    fix = f"fix: {_either(fixes)}" if fixes else \
        f"no fix up to {world * _ADVICE_GPU_FACTOR} GPUs: a device with more memory"
    return f"no grid of {world} x {result.machine.device.name} fits: {why}; {fix}"


def _no_grid_message(model: ModelConfig, world_size: int, global_batch: int,
                     rejected: list[tuple[GridShape, str]], optimizer: str = "adamw") -> str:
    batch_ok = [(s, why) for s, why in rejected
                if global_batch % batch_split(s, optimizer) == 0]
    if not batch_ok:
        axes = "*".join(batch_axes(optimizer))
        return (f"--global-batch {global_batch}: no grid of {world_size} GPUs can split it "
                f"({axes} must divide the batch); try a multiple of {world_size}")
    shape, why = batch_ok[0]
    return (f"no grid of {world_size} GPUs can split model {model_label(model)!r} with --global-batch "
            f"{global_batch}: the grids that split the batch cannot split the model ({shape}: "
            f"{why}); try another GPU count or a batch that is a multiple of {world_size}")


def choose_grid(model_cfg: ModelConfig, world_size: int, machine: Machine | str,
                global_batch: int, seq_len: int, dtype: str = "float32",
                overlap: Overlap = Overlap(), activation_checkpointing: bool | None = None,
                grad_accum: int | None = None, reduce_dtype: str = "float32",
                train: "TrainConfig | None" = None) -> tuple[GridShape, str]:
    """The fastest grid predicted to fit, and a few lines explaining the choice.

    `activation_checkpointing` / `grad_accum` fix those settings (as the run's config does);
    None lets the planner pick. `reduce_dtype` and `overlap.overlap_forward` are the run's
    parallel.reduce_dtype / overlap_forward (the bytes and overlaps it will have). `train`:
    the run's train config, whose train.optimizer's memory the grid must fit (None: AdamW's).
    Raises PlanError when no grid fits in memory.
    """
    from fourfold.plan.machine_file import load_machine

    m = load_machine(machine)
    checkpointing = (False, True) if activation_checkpointing is None else \
        (activation_checkpointing,)
    result = plan(model_cfg, world_size, m, global_batch, seq_len, dtype, overlap,
                  checkpointing, grad_accum, (reduce_dtype,), train=train)
    best = result.best
    if not best.fits:
        raise PlanError(f"no grid of {world_size} x {m.device.name} fits model "
                        f"{model_label(model_cfg)!r} under {result.optimizer}: the smallest needs "
                        f"{best.memory.total / GIB:.1f} GiB per rank, "
                        f"{best.usable_bytes / GIB:.1f} GiB usable")
    p = best.prediction
    lines = [f"planner chose {best.shape} on {m.name} ({world_size} ranks): predicted "
             f"{p.step_s * 1e3:.1f} ms/step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.0%}, "
             f"{best.memory.total / GIB:.2f} GiB/rank under {result.optimizer}",
             f"  micro-batch {best.micro_batch} x grad_accum {best.grad_accum}, activation "
             f"checkpointing {'on' if best.activation_checkpointing else 'off'}, reduce_dtype "
             f"{best.reduce_dtype}, overlap_forward {'on' if best.overlap_forward else 'off'}",
             "  comm per step (total/hidden ms): " + ", ".join(
                 f"{a} {p.comm_s[a] * 1e3:.1f}/{p.hidden_s[a] * 1e3:.1f}" for a in AXES)]
    fitting = [c for c in result.candidates if c.fits]
    if len(fitting) > 1:
        runner = fitting[1]
        lines.append(f"  next best: {runner.shape} at {runner.prediction.step_s * 1e3:.1f} "
                     f"ms/step ({len(fitting)} grids fit, {len(result.rejected)} cannot split "
                     "the model)")
    return best.shape, "\n".join(lines)


def rank_memory_capacity(device: "torch.device", local_ranks: int) -> int:
    """Bytes one rank can use: its GPU's memory, or the host's memory shared by the ranks on
    it (MemTotal: a run must not be refused for what other programs hold right now)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // max(1, local_ranks)
    raise PlanError("cannot read the host's memory size from /proc/meminfo")


def check_grid_fits(cfg: "Config", shape: GridShape, on_host: bool, capacity: int,
                    resumed: bool = False) -> None:
    """Raise a one-line PlanError, before anything is built, when a rank of `shape` with
    `capacity` bytes cannot hold the run of `cfg` under its training method (its peak:
    memory.predicted_memory, `on_host` and `resumed` as it takes them), naming the bytes needed
    and a grid that would fit (the planner's grid search, on as many ranks as it takes)."""
    t = cfg.train
    mem = predicted_memory(cfg, shape, on_host, resumed)
    if mem.total <= capacity:
        return
    suggestion = "no grid of up to 2^20 ranks does"
    world = shape.size
    while world <= 2**20:
        fitting = [(predicted_memory(cfg, s, on_host, resumed).total, s)
                   for s in grid_shapes(world)
                   if grid_problem(cfg.model, s, t.batch_size, t.optimizer) is None]
        fitting = [(n, s) for n, s in fitting if n <= capacity]
        if fitting:
            n, s = min(fitting, key=lambda f: (f[0], str(f[1])))
            suggestion = (f"a grid that fits: parallel.x={s.x} y={s.y} z={s.z} data={s.data} "
                          f"({world} ranks, {n / GIB:.2f} GiB each)")
            break
        world *= 2
    state = mem.params + mem.grads + mem.optimizer
    raise PlanError(f"grid {shape} cannot hold model {cfg.model.preset!r} under "
                    f"train.optimizer = {t.optimizer!r}: a rank needs {mem.total / GIB:.2f} GiB "
                    f"({state / GIB:.2f} GiB weights, gradients and optimizer state + "
                    f"{(mem.total - state) / GIB:.2f} GiB at the peak of a step, build or "
                    f"export) and has {capacity / GIB:.2f} GiB; {suggestion}")
