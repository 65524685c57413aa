"""`fourfold simulate`: the real build and training steps of chosen ranks of an N-rank job, in
one process, with no data behind the tensors.

Each simulated rank joins torch's fake process group (`init_process_group("fake", rank=R,
world_size=N)`: every collective returns at once and moves nothing) and runs under
FakeTensorMode (every tensor has a shape, dtype and device, no storage): the grid's groups,
the model's shards, the engine and the trainer's `train_step` are fourfold's own code. What it
measures, per rank:

- the peak of live tensor bytes, by phase (build, forward, backward, optimizer step): a
  dispatch mode sees every tensor an operator returns and counts each storage from its first
  appearance until it is freed (a weak reference's callback);
- the bytes and calls per axis and dtype of the engine's ledger over one step (the second:
  the first may differ by one-time work), beside the planner's `predict_step` bytes;
- the trace of collectives (operation, group, dtype, shape) from the build to the last step:
  the ranks of one group must issue the same sequence, or a real job hangs
  (`first_trace_difference`).

By default the steps are a whole run through `Trainer.fit` in a temporary run directory: the
log of the last step, the validations, the checkpoint after the last step, the final export's
stream, the final sample and summary.json, each part a phase of its own, with no tensor
written (fake tensors have no bytes: a simulated grid, `Grid.simulated`, stages its checkpoints
and streams its export without writing them). Fake shards get no initial values (their
tile-by-tile computation is left out of the build, and with it at most one tile of 4 MiB from
the build's peak). The fake group and tensors answer no question about values: a host read of
a fake tensor (`.item()`, `bool(t)`) raises in a step, and outside the steps is answered "no
value" (NaN, 0, False).

With a device (`device="cpu"` or `"cuda"`) the rank's shards are real tensors on it and every
kernel runs; only the collectives stay on the fake group (whose gathers copy the local shard
into every slot, so values stay finite). The rank then also reports its real memory per phase
(`DeviceMemory`: on CUDA the allocator's peak, on the CPU the growth of the process's resident
peak) and its loss.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import math
import sys
import tempfile
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fourfold.config import Config, validate
from fourfold.data.loader import Batch
from fourfold.errors import FourfoldError
from fourfold.intmath import GIB
from fourfold.parallel.comm import CollectiveCall
from fourfold.parallel.grid import AXES, RANK_ORDER, Axis, Grid, GridShape
from fourfold.plan.catalog import Machine
from fourfold.plan.memory import MemoryBreakdown
from fourfold.plan.perf import StepPrediction
from fourfold.train.metrics import proc_status_bytes

PHASES = ("build", "forward", "backward", "optimizer")  # of the training steps
# the rest of a run (Trainer.fit), after the steps: a validation, a checkpoint's staging, the
# final export's stream (their file writes skipped: fake tensors have no bytes to write)
FIT_PHASES = ("validation", "sample", "checkpoint", "export")


class SimulationError(FourfoldError, RuntimeError):
    """A simulated job that would fail on a real cluster (a rank out of memory, ranks of one
    group issuing different collectives); one line for the user."""


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages alive, and their peak per phase: every tensor an
    operator returns is looked at, its storage counted once from then until it is freed.
    With `answer`, a host read of a fake tensor gets its answer (`no_value`, `healthy_value`);
    without, it raises."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.phase = "build"
        self.peaks: dict[str, int] = {p: 0 for p in PHASES + FIT_PHASES}
        self._seen: dict[int, int] = {}  # storage id -> bytes
        # what a host read of a fake tensor gets (by the tensor's dtype); None: it raises, as
        # a host read inside a step that keeps its numbers on the device should
        self.answer: Callable[[torch.dtype], float | int | bool] | None = None

    def enter(self, phase: str) -> None:
        """Start `phase`: its peak is at least what is alive as it begins."""
        self.phase = phase
        self.peaks[phase] = max(self.peaks[phase], self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if self.answer is not None and func is torch.ops.aten._local_scalar_dense.default \
                and _is_fake(args[0]):
            # a host read of a fake tensor (`.item()`, `float(t)`, `.tolist()`): it has no
            # value, the answerer gives one
            return self.answer(args[0].dtype)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            # a meta tensor (the model declared before its shards are built) holds nothing
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        weakref.finalize(storage, self._free, key)
        if self.live > self.peaks[self.phase]:
            self.peaks[self.phase] = self.live

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key)


DEVICES = ("cpu", "cuda")


class DeviceMemory:
    """The real memory of a rank that runs on a device, by phase: on CUDA the allocator's peak
    of allocated bytes (`torch.cuda.max_memory_allocated`, reset as each phase begins), on the
    CPU the growth of the process's resident peak (VmHWM) over its resident size before the
    build (reset as each phase begins where the kernel allows: /proc/self/clear_refs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, int] = {p: 0 for p in PHASES + FIT_PHASES}
        self.phase = "build"
        # an earlier simulated rank's tensors, some held in reference cycles, freed first
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = 0
            self.start = torch.cuda.memory_allocated(device)  # a leak would show here
        else:
            self.baseline = self.start = proc_status_bytes("VmRSS")
            self.resettable = _reset_resident_peak()

    def enter(self, phase: str) -> None:
        """Close the phase under way (its peak) and start `phase`."""
        self.close()
        self.phase = phase

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peak = proc_status_bytes("VmHWM") - self.baseline
            if self.resettable:
                _reset_resident_peak()
        self.peaks[self.phase] = max(self.peaks[self.phase], peak)

    def reserved(self) -> int:
        """The CUDA allocator's peak of reserved bytes (0 on the CPU)."""
        return torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else 0


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def no_value(dtype: torch.dtype) -> float | int | bool:
    """A host read's answer where the code only reports what it reads (the log, a validation
    loss): NaN (a float), 0 or False, which say there is no value."""
    if dtype == torch.bool:
        return False
    return math.nan if dtype.is_floating_point or dtype.is_complex else 0


def healthy_value(dtype: torch.dtype) -> float | int | bool:
    """A host read's answer inside a step that reads numbers on the host by design (a lean
    method's loss, MeZO's projected gradient, BlockLLM's gradient norms): 1 (1.0, True), finite
    and positive, so that the step takes the way of a healthy one (no guard trips on it, no
    update is skipped)."""
    if dtype == torch.bool:
        return True
    return 1.0 if dtype.is_floating_point or dtype.is_complex else 1


def _reset_resident_peak() -> bool:
    """Reset this process's VmHWM to its resident size now; whether the kernel allowed it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


@dataclass
class RankReport:
    """What one simulated rank did, beside the planner's figures."""

    rank: int
    coords: dict[Axis, int]
    peaks: dict[str, int]  # phase -> peak live tensor bytes
    step_bytes: dict[str, int]  # axis -> bytes of one step, as the ledger counts
    by_dtype: dict[tuple[str, str], tuple[int, int]]  # (group, dtype) -> (bytes, calls), a step
    group_seconds: float
    build_seconds: float
    step_seconds: list[float]
    shard_shapes: dict[str, tuple[int, ...]]
    trace: list[CollectiveCall] = field(repr=False)
    planned_memory: MemoryBreakdown | None = None
    planned_bytes: dict[str, int] = field(default_factory=dict)
    planned_compute_s: float | None = None  # the planner's compute time of one step
    staged_bytes: int = 0  # the tensors a checkpoint's snapshot holds (copies under async)
    export_largest: int = 0  # the largest full tensor the export assembles (on rank 0)
    device: str | None = None  # where the shards were real ("cpu", "cuda"); None: fake tensors
    device_peaks: dict[str, int] = field(default_factory=dict)  # phase -> real peak bytes
    device_reserved: int = 0  # the CUDA allocator's peak of reserved bytes
    device_start: int = 0  # allocated on cuda (resident on cpu) before the build
    losses: list[float] = field(default_factory=list)  # the steps' losses (real tensors only)

    @property
    def peak(self) -> int:
        """The peak of the training steps (build, forward, backward, optimizer)."""
        return max(self.peaks[p] for p in PHASES)


class SimulatedBatches:
    """A loader's whole steps as fake token tensors of the shape the real loader hands out."""

    def __init__(self, rows: int, seq_len: int, vocab_size: int) -> None:
        self.rows, self.seq_len, self.vocab_size = rows, seq_len, vocab_size

    def next_batch(self) -> Batch:
        tokens = torch.randint(0, self.vocab_size, (self.rows, self.seq_len + 1))
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def eval_batches(self, n: int) -> list[Batch]:
        return [self.next_batch() for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def simulation_config(cfg: Config, shape: GridShape, steps: int = 2) -> Config:
    """cfg for a simulated rank of `shape` whose run is `steps` steps: nothing that reads
    values on the host (resume, the memory report, GEMM tuning, compilation), no experiment
    tracker, and each of fit()'s periodic parts due once, after the last step: the log, a
    checkpoint (which any run writes on SIGTERM), and those cfg runs at all: a validation of
    one batch, the sample at the end, of at most two tokens (each validation batch and each
    generated token runs the same code)."""
    cfg = copy.deepcopy(cfg)
    t = cfg.train
    cfg.parallel = dataclasses.replace(cfg.parallel, x=shape.x, y=shape.y, z=shape.z,
                                       data=shape.data, auto=False, gemm_tuning=False)
    cfg.train = dataclasses.replace(
        t, memory_report=False, compile=False, tensorboard=False, steps=steps, log_every=steps,
        eval_batches=min(t.eval_batches, 1), eval_every=steps if t.eval_every > 0 else 0,
        sample_every=0, sample_tokens=min(t.sample_tokens, 2),
        warmup_steps=min(t.warmup_steps, steps))
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, resume=False, every=steps)
    cfg.logging = dataclasses.replace(cfg.logging, trackers=[])
    validate(cfg)
    return cfg


def default_ranks(shape: GridShape) -> list[int]:
    """One rank per distinct coordinate class: every combination of the first and the last
    coordinate on each axis."""
    ranks = {0}
    for corner in range(2 ** len(AXES)):
        coords = {a: (getattr(shape, a) - 1 if corner >> i & 1 else 0)
                  for i, a in enumerate(AXES)}
        ranks.add(shape.rank_of(coords))
    return sorted(ranks)


def simulate_rank(cfg: Config, shape: GridShape, rank: int, on_host: bool = False,
                  steps: int = 2, progress: Callable[[str], None] | None = None,
                  device: str | None = None, resumed: bool = False,
                  whole_run: bool = True) -> RankReport:
    """Build rank `rank` of a job on `shape` and run `steps` training steps, under the fake
    process group and fake tensors (torch.distributed must not be initialized). `on_host`:
    the simulated ranks keep their tensors in host memory (the host-memory policy's choices,
    as the planner's machine has it). `device` ("cpu", "cuda"): real shards on it and real
    kernels, only the collectives fake. `resumed`: start as a resumed run does, with the
    optimizer's state made before the first step (init_optimizer_state, which a checkpoint
    loads into), so that the first step already holds what every later one holds and one step
    reaches a run's peak (a fresh run makes the state in its first step's update).
    `whole_run`: the steps as a run through Trainer.fit (see _fit); else the steps alone."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException, FakeTensorMode)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fourfold.data.tokenizers import ByteTokenizer
    from fourfold.methods import method_spec
    from fourfold.train.build import Run, build_model_parts
    from fourfold.train.checkpoint import init_optimizer_state
    from fourfold.train.host_memory import HostMemory
    from fourfold.train.methods import batch_shard
    from fourfold.train.resilience import LossGuard
    from fourfold.train.trainer import Trainer

    say = progress or (lambda line: None)
    cfg = simulation_config(cfg, shape, steps)
    # checkpoints staged as the machine's ranks stage them (on a GPU: copies in host memory)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint,
                                         async_save=cfg.checkpoint.is_async(on_host))
    t = cfg.train
    where = simulation_device(device)
    tensors = (contextlib.nullcontext() if device is not None
               else FakeTensorMode(allow_non_fake_inputs=True))
    dist.init_process_group("fake", rank=rank, world_size=shape.size, store=FakeStore())
    counter = LiveBytes()
    try:
        with contextlib.ExitStack() as stack, tensors, counter:
            meter = DeviceMemory(where) if device is not None else None
            start = time.perf_counter()
            grid = Grid.build(shape, where, timeout_s=cfg.parallel.timeout_s)
            group_seconds = time.perf_counter() - start
            torch.manual_seed(t.seed)
            host = HostMemory(on_host, shape.size, t.dtype)  # not tuned: a simulation
            pmodel, compiler, method = build_model_parts(cfg, grid, host)
            trace: list[CollectiveCall] = []
            pmodel.ledger.trace = trace
            _synchronize(where)
            build_seconds = time.perf_counter() - start
            say(f"rank {rank}: built in {build_seconds:.1f} s "
                f"({counter.peaks['build'] / GIB:.2f} GiB live at most)")
            _, shard_count = batch_shard(grid, method_spec(t.optimizer).batch_axes)
            batches = SimulatedBatches(t.batch_size // shard_count, t.seq_len,
                                       cfg.model.vocab_size)
            run_dir = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="fourfold-simulate-")))
            run = Run(cfg=cfg, run_dir=run_dir, rank=rank, world_size=shape.size,
                      device=grid.device, grid=grid, data_dir=run_dir,
                      # the sample's tokens are fake (0): bytes decode them
                      tokenizer=ByteTokenizer(), pmodel=pmodel, compiler=compiler,
                      method=method, host=host,
                      loader=batches, val_loader=batches,  # type: ignore[arg-type]
                      guard=LossGuard(t.spike_threshold))
            trainer = Trainer.from_run(run, progress=False)
            optimizer = getattr(method, "optimizer", None)
            if resumed and optimizer is not None:
                _enter_phase(counter, meter, "optimizer")
                init_optimizer_state(optimizer)
            # a step that reads numbers on the host by design gets healthy ones from fake
            # tensors; one that keeps them on the device must not read any
            answer = healthy_value if method_spec(t.optimizer).step_reads_host else None
            steps_run = _StepRecord(trainer, _PhaseWatch(counter, meter, pmodel, optimizer),
                                    where, real=device is not None, say=say, steps=steps,
                                    answer=answer)
            if whole_run:
                _fit(trainer, steps_run, counter, meter)
                say(f"rank {rank}: the run's end (log, validation, sample, checkpoint, "
                    "export) done")
            else:
                for _ in range(steps):
                    steps_run.step()
            by_dtype: dict[tuple[str, str], tuple[int, int]] = defaultdict(lambda: (0, 0))
            for call in steps_run.last_step_calls():
                nbytes, calls = by_dtype[(call.axis, call.dtype)]
                by_dtype[(call.axis, call.dtype)] = (nbytes + call.nbytes, calls + 1)
            if meter is not None:
                meter.close()
            shapes = {name: tuple(p.shape) for name, p in pmodel.named_parameters()}
            # the largest full tensor rank 0's export assembles
            largest = max((math.prod(spec.shape) * spec.dtype.itemsize
                           for spec in pmodel.full_tensor_specs()), default=0) \
                if rank == 0 and whole_run else 0
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        # an operator whose output's shape depends on values (a selection by value: BlockLLM's
        # rows) has no answer without values
        raise SimulationError(
            f"rank {rank}: train.optimizer = {t.optimizer!r} runs {e.func} on values "
            "(its output's shape depends on them), which fake tensors do not have; simulate "
            "it with real tensors: --device cpu or --device cuda") from None
    finally:
        dist.destroy_process_group()
    return RankReport(rank=rank, coords=shape.coords(rank), peaks=dict(counter.peaks),
                      step_bytes=steps_run.step_bytes, by_dtype=dict(by_dtype),
                      group_seconds=group_seconds, build_seconds=build_seconds,
                      step_seconds=steps_run.seconds, shard_shapes=shapes, trace=list(trace),
                      device=device, device_peaks=dict(meter.peaks) if meter else {},
                      device_reserved=meter.reserved() if meter else 0,
                      device_start=meter.start if meter else 0, losses=steps_run.losses,
                      staged_bytes=trainer.checkpoints.staged_bytes,
                      export_largest=largest)


class _StepRecord:
    """Runs the trainer's steps (its own `train_step`, which fit() calls in its place) with
    the phase hooks on, each timed to the device's end, and keeps what the report needs of
    them: the ledger's bytes of the last one, where its collectives end in the trace, and the
    losses of real tensors. A host read of a fake tensor inside a step gets `answer`, or
    raises (None)."""

    def __init__(self, trainer: Any, watch: _PhaseWatch, where: torch.device, real: bool,
                 say: Callable[[str], None], steps: int,
                 answer: Callable[[torch.dtype], float | int | bool] | None) -> None:
        self.train_step, self.watch, self.where = trainer.train_step, watch, where
        self.answer = answer
        self.real, self.say, self.steps = real, say, steps
        self.ledger, self.trace = trainer.pmodel.ledger, trainer.pmodel.ledger.trace
        self.rank = trainer.grid.rank
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.step_bytes: dict[str, int] = {}
        self._trace_end = self._step_calls = 0  # len(trace), the ledger's calls: the last step

    def step(self) -> Any:
        counter = self.watch.counter
        outside, counter.answer = counter.answer, self.answer
        begun = time.perf_counter()
        try:
            with self.watch:
                stats = self.train_step()
            _synchronize(self.where)
        finally:
            counter.answer = outside
        self.seconds.append(time.perf_counter() - begun)
        # the ledger counts this step (the trainer resets it as a step begins)
        self.step_bytes = self.ledger.snapshot()
        self._trace_end, self._step_calls = len(self.trace), sum(self.ledger.calls.values())
        if self.real:
            self.losses.append(stats.loss)
        self.say(f"rank {self.rank}: step {len(self.seconds)} of {self.steps} in "
                 f"{self.seconds[-1]:.1f} s")
        return stats

    def last_step_calls(self) -> list[CollectiveCall]:
        """The collectives of the last step, in the order it issued them."""
        return self.trace[self._trace_end - self._step_calls:self._trace_end]


def _fit(trainer: Any, steps: _StepRecord, counter: LiveBytes,
         meter: DeviceMemory | None) -> None:
    """The whole run through `Trainer.fit`, in a temporary run directory: its steps (`steps`),
    the log of its last one (the straggler report's gather included), its validations (at
    step 0 and after the last step), the checkpoint after the last step (staged, not written:
    CheckpointManager under a simulated grid), then `finish`: the final export's stream (rank
    0 assembles each full tensor in turn; nothing written; an adapter run's files are not
    simulated), the final sample and summary.json. Each part is a phase of its own. Outside
    the steps, host reads of fake tensors (the losses, the sample's tokens) are answered "no
    value"."""
    def phased(run: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            _enter_phase(counter, meter, phase)
            return run(*args)
        return wrapped

    trainer.train_step = steps.step
    trainer.evaluate = phased(trainer.evaluate, "validation")
    trainer.sample_text = phased(trainer.sample_text, "sample")
    trainer.save_checkpoint = phased(trainer.save_checkpoint, "checkpoint")
    trainer.finish = phased(trainer.finish, "export")
    counter.answer = no_value
    try:
        # the run's own lines (its progress, of "no value" numbers) are not the simulation's
        with contextlib.redirect_stderr(io.StringIO()):
            trainer.fit()
    finally:
        counter.answer = None


def _enter_phase(counter: LiveBytes, meter: DeviceMemory | None, phase: str) -> None:
    counter.enter(phase)
    if meter is not None:
        meter.enter(phase)


def simulation_device(device: str | None) -> torch.device:
    """The torch device of a simulated rank: the CPU for fake tensors, else `device` (one of
    DEVICES; "cuda" is the current CUDA device: every simulated rank shares one GPU)."""
    if device is not None and device not in DEVICES:
        raise SimulationError(f"--device {device}: choose one of {', '.join(DEVICES)}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SimulationError("--device cuda: no CUDA device is available here; use "
                                  "--device cpu, or no --device for fake tensors")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a time is of the work, not of queuing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _PhaseWatch:
    """Sets the counter's phase from hooks: the model's forward, the start of its backward
    (the output's gradient) and the optimizer's step (a method without a torch optimizer
    updates within its backward)."""

    def __init__(self, counter: LiveBytes, meter: DeviceMemory | None, pmodel: Any,
                 optimizer: Any) -> None:
        self.counter, self.meter, self.pmodel, self.optimizer = counter, meter, pmodel, optimizer
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        module = self.pmodel.module
        self.handles = [module.register_forward_pre_hook(self._forward),
                        module.register_forward_hook(self._forward_done)]
        if self.optimizer is not None:
            self.handles.append(self.optimizer.register_step_pre_hook(self._optimizer))

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _forward(self, module: Any, args: Any) -> None:
        _enter_phase(self.counter, self.meter, "forward")

    def _forward_done(self, module: Any, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        _enter_phase(self.counter, self.meter, "backward")

    def _optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        _enter_phase(self.counter, self.meter, "optimizer")


def group_members(shape: GridShape, a: int, b: int, group: str) -> bool:
    """Whether ranks a and b are in one group `group` (an axis, "tensor" or "all")."""
    if group == "all":
        return True
    ca, cb = shape.coords(a), shape.coords(b)
    if group == "tensor":
        return ca["data"] == cb["data"]
    return all(ca[x] == cb[x] for x in AXES if x != group)


def first_trace_difference(shape: GridShape, reports: list[RankReport]) -> str | None:
    """The first collective that two simulated ranks of one group issue differently on it
    (None when every group's ranks agree)."""
    groups = ("x", "y", "z", "data", "tensor", "all")
    for i, a in enumerate(reports):
        for b in reports[i + 1:]:
            for group in groups:
                if not group_members(shape, a.rank, b.rank, group):
                    continue
                ta = [c for c in a.trace if c.axis == group]
                tb = [c for c in b.trace if c.axis == group]
                for n, (ca, cb) in enumerate(zip(ta, tb)):
                    if (ca.op, ca.dtype, ca.shape) != (cb.op, cb.dtype, cb.shape):
                        return (f"ranks {a.rank} and {b.rank} share a {group} group but their "
                                f"collective {n + 1} on it differs: {_call(ca)} against "
                                f"{_call(cb)}")
                if len(ta) != len(tb):
                    return (f"ranks {a.rank} and {b.rank} share a {group} group but issue "
                            f"{len(ta)} and {len(tb)} collectives on it")
    return None


def _call(c: CollectiveCall) -> str:
    return f"{c.op} {c.dtype} {list(c.shape)}"


def planner_figures(cfg: Config, shape: GridShape, machine: Machine
                    ) -> tuple[MemoryBreakdown, StepPrediction]:
    """The planner's peak memory per rank and its prediction of one step (its compute time,
    its bytes per axis) for cfg on `shape`."""
    from fourfold.plan.memory import predicted_memory

    return (predicted_memory(cfg, shape, machine.device.shared_host),
            planned_step(cfg, shape, machine))


def planned_step(cfg: Config, shape: GridShape, machine: Machine) -> StepPrediction:
    """The planner's prediction of one step of cfg on `shape` (its time and bytes)."""
    from fourfold.methods import method_spec
    from fourfold.parallel.embedding import resolve_output_loss
    from fourfold.plan.memory import Precision
    from fourfold.plan.perf import Overlap, predict_step

    t, p = cfg.train, cfg.parallel
    overlap = Overlap(overlap_input_grad=p.overlap_input_grad,
                      overlap_weight_grad=p.overlap_weight_grad,
                      prefetch_weights=p.prefetch_weights,
                      overlap_data_grad=p.overlap_data_grad,
                      overlap_forward=p.overlap_forward)
    return predict_step(cfg.model, shape, t.batch_size, t.seq_len, t.grad_accum,
                        t.activation_checkpointing, machine,
                        Precision.of(t.dtype, p.reduce_dtype), overlap,
                        resolve_output_loss(p.output_loss,
                                            method_spec(t.optimizer).blocked_loss), train=t)


def simulate(cfg: Config, shape: GridShape, ranks: list[int], machine: Machine,
             steps: int = 2, progress: Callable[[str], None] | None = None,
             device: str | None = None, resumed: bool = False,
             whole_run: bool = True) -> list[RankReport]:
    """Simulate each of `ranks` of a job of cfg on `shape`, with the planner's figures
    (`steps`, `device`, `resumed`, `whole_run`: as simulate_rank has them)."""
    for rank in ranks:
        if not 0 <= rank < shape.size:
            raise SimulationError(f"--ranks {rank}: the grid {shape} has ranks 0 to "
                                  f"{shape.size - 1}")
    simulation_device(device)  # a wrong or absent device: one error before any rank
    memory, step = planner_figures(simulation_config(cfg, shape), shape, machine)
    reports = []
    for i, rank in enumerate(ranks):
        if progress:
            progress(f"simulating rank {rank} ({i + 1} of {len(ranks)}) of grid {shape}"
                     + (f" with real tensors on {device}" if device else ""))
        report = simulate_rank(cfg, shape, rank, machine.device.shared_host, steps, progress,
                               device, resumed, whole_run)
        report.planned_memory, report.planned_bytes = memory, dict(step.comm_bytes)
        report.planned_compute_s = step.compute_s
        reports.append(report)
    return reports


def format_report(reports: list[RankReport], shape: GridShape, machine: Machine) -> str:
    """A table per rank: peaks by phase, bytes per axis and per (group, dtype), shard shapes."""
    lines = []
    for r in reports:
        mem = r.planned_memory
        coords = " ".join(f"{a}={r.coords[a]}" for a in RANK_ORDER)
        lines.append(f"rank {r.rank} ({coords}) of grid {shape} on {machine.name}: groups "
                     f"{r.group_seconds:.2f} s, build {r.build_seconds:.1f} s, steps "
                     + ", ".join(f"{s:.1f}" for s in r.step_seconds) + " s")
        lines.append("  peak live tensors by phase: " + ", ".join(
            f"{p} {_amount(r.peaks[p])}" for p in PHASES))
        if not any(r.peaks.get(p) for p in FIT_PHASES):
            lines.append("  the rest of fit(): not run (the steps only)")
        else:
            lines.append("  the rest of fit() (no tensor written): " + ", ".join(
                f"{p} {_amount(r.peaks[p]) if r.peaks.get(p) else 'not run'}"
                for p in FIT_PHASES)
                + f"; the checkpoint's snapshot holds {_amount(r.staged_bytes)}"
                + (f", the export's largest full tensor {_amount(r.export_largest)}"
                   if r.export_largest else ""))
        if r.device is not None:
            lines += _device_lines(r, machine)
        if mem is not None:
            tensors = planner_tensor_bytes(mem)
            lines.append(f"  planner: {_amount(mem.total)} in all, {_amount(tensors)} of "
                         f"tensors (runtime {_amount(mem.runtime)}); simulated peak "
                         f"{_amount(r.peak)} ({(r.peak / max(tensors, 1) - 1) * 100:+.1f}%)")
        lines.append("  bytes per step   " + "  ".join(f"{a:>14}" for a in AXES))
        lines.append("  simulated        " + "  ".join(
            f"{r.step_bytes.get(a, 0):>14,}" for a in AXES))
        lines.append("  planner          " + "  ".join(
            f"{r.planned_bytes.get(a, 0):>14,}" for a in AXES))
        for (group, dtype), (nbytes, calls) in sorted(r.by_dtype.items()):
            lines.append(f"  {group:>6} {dtype:<9} {calls:>6} calls {nbytes:>16,} bytes")
        shown = [(n, s) for n, s in r.shard_shapes.items()
                 if ".layers." not in f".{n}" or ".layers.0." in f".{n}"]
        lines.append("  shards: " + ", ".join(f"{n} {list(s)}" for n, s in shown))
    return "\n".join(lines)


def _device_lines(r: RankReport, machine: Machine) -> list[str]:
    """What a rank with real tensors measured: its real peaks, losses and compute times."""
    what = ("allocated on cuda (torch.cuda.max_memory_allocated)" if r.device == "cuda"
            else "resident growth on cpu (VmHWM)")
    lines = [f"  real peak {what} by phase: " + ", ".join(
        f"{p} {_amount(r.device_peaks.get(p, 0))}" for p in PHASES + FIT_PHASES)
        + (f"; reserved {_amount(r.device_reserved)}" if r.device == "cuda" else "")
        + f"; {_amount(r.device_start)} {'allocated' if r.device == 'cuda' else 'resident'} "
          "before the build"]
    lines.append("  loss per step: " + ", ".join(f"{loss:.4f}" for loss in r.losses)
                 + "; compute per step: " + ", ".join(f"{s:.3f}" for s in r.step_seconds)
                 + f" s on {r.device} (collectives fake: no communication time)"
                 + ("" if r.planned_compute_s is None else
                    f"; planner {r.planned_compute_s:.3f} s on {machine.device.name}"))
    return lines


def _amount(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def planner_tensor_bytes(mem: MemoryBreakdown) -> int:
    """The planner's peak less what is not a tensor (the runtime's pages on a host)."""
    return mem.total - mem.runtime


def check_reports(reports: list[RankReport], shape: GridShape, machine: Machine) -> None:
    """SimulationError when a rank does not fit the machine or a group's ranks disagree."""
    capacity = machine.usable_memory_bytes(shape.size)
    for r in reports:
        if r.peak > capacity:
            raise SimulationError(
                f"rank {r.rank} of grid {shape} peaks at {r.peak / GIB:.2f} GiB of live "
                f"tensors, more than the {capacity / GIB:.2f} GiB a rank has on "
                f"{machine.name}; use more ranks or a grid the planner accepts")
    difference = first_trace_difference(shape, reports)
    if difference is not None:
        raise SimulationError(f"grid {shape} would hang: {difference}")


def simulate_main(config: str | None, world: int, grid: str | None, ranks: str | None,
                  machine_name: str | None, overrides: list[str],
                  device: str | None = None, whole_run: bool = True) -> int:
    """`fourfold simulate`: print the table, 0, or raise SimulationError (`device`,
    `whole_run`: as simulate_rank has them)."""
    from fourfold.config import ConfigError, load_config
    from fourfold.plan.machine_file import load_machine

    cfg = load_config(config, overrides)
    machine = load_machine(machine_name or cfg.parallel.machine)
    if world < 1:
        raise ConfigError(f"--world {world}: must be at least 1")
    if grid:
        sizes = _ints(grid, "--grid")
        if len(sizes) != 4:
            raise ConfigError(f"--grid {grid}: give data,z,y,x (four sizes)")
        shape = GridShape.resolve(sizes[3], sizes[2], sizes[1], sizes[0], world)
    elif cfg.parallel.auto:
        shape = _planned_shape(cfg, world, machine)
    else:
        p = cfg.parallel
        shape = GridShape.resolve(p.x, p.y, p.z, p.data, world)
    chosen = _ints(ranks, "--ranks") if ranks else default_ranks(shape)
    return _simulate_and_print(cfg, shape, chosen, machine, device, whole_run)


def simulate_planned(cfg: Config, shape: GridShape, machine: Machine) -> int:
    """`fourfold plan --simulate`: the planner's top row (cfg, its grid) simulated on its
    default ranks; the table printed, 0, or SimulationError."""
    return _simulate_and_print(cfg, shape, default_ranks(shape), machine, None)


def _simulate_and_print(cfg: Config, shape: GridShape, ranks: list[int], machine: Machine,
                        device: str | None, whole_run: bool = True) -> int:
    stream = sys.stderr  # this one: a simulated run's own output is swallowed (see _fit)
    reports = simulate(cfg, shape, ranks, machine,
                       progress=lambda line: print(line, file=stream, flush=True),
                       device=device, whole_run=whole_run)
    print(format_report(reports, shape, machine))
    check_reports(reports, shape, machine)
    return 0


def _planned_shape(cfg: Config, world: int, machine: Machine) -> GridShape:
    from fourfold.plan import choose_grid

    t = cfg.train
    shape, why = choose_grid(cfg.model, world, machine, t.batch_size, t.seq_len, dtype=t.dtype,
                             activation_checkpointing=t.activation_checkpointing,
                             grad_accum=t.grad_accum, reduce_dtype=cfg.parallel.reduce_dtype,
                             train=t)
    print(f"the planner chose grid {shape}: {why}", file=sys.stderr, flush=True)
    return shape


def _ints(text: str, option: str) -> list[int]:
    from fourfold.config import ConfigError

    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option} {text}: give integers separated by commas") from None


__all__ = ["DEVICES", "FIT_PHASES", "PHASES", "DeviceMemory", "LiveBytes", "RankReport",
           "SimulationError", "check_reports", "default_ranks", "first_trace_difference",
           "format_report", "planned_step", "planner_figures", "simulate", "simulate_main",
           "simulate_planned", "simulate_rank", "simulation_device"]
