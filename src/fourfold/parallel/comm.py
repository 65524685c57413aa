"""Every collective of the engine goes through `Comm`: it issues the op on the axis's process
group, records the bytes in the `CommLedger`, and turns a failure or timeout into a
`CollectiveError` that names the rank, the op and the axis.

Ledger convention (the planner predicts the same numbers): per rank, the bytes of the buffer
handed to the collective — the input of an all-reduce or reduce-scatter, the output of an
all-gather. A collective over an axis of size 1 moves nothing and records nothing; it is issued
only where the grid has a group for the axis all the same (a one-process run that forces the
engine, Grid.build's `force_groups`, so that the backend's code runs), otherwise skipped.

A ledger may also keep a trace: one `CollectiveCall` (operation, axis, dtype, shape of the
buffer) per recorded collective, in issue order. The ranks of one group must issue the same
sequence on it, or a real job hangs; `fourfold simulate` compares the traces of ranks.

A caller may name a `wire_dtype`: the buffer is cast to it before the collective and the
result cast back, so the ledger counts the cast buffer (what torch.distributed is handed).

Backend quirks live here and nowhere else: gloo before torch 2.13 (not checked below that)
is not trusted with 16-bit floats, which then travel as float32 (the algorithm's bytes are
recorded under the axis, the extra bytes the emulation moved under `emulated`); torch 2.13's
gloo all-reduces (sum and max), all-gathers and reduce-scatters bfloat16 and float16 natively.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from fourfold.errors import first_line
from fourfold.parallel.grid import Grid

LEDGER_KEYS = ("x", "y", "z", "data", "all")


class CollectiveError(RuntimeError):
    """A collective failed or timed out; usually another rank died or hangs."""


@dataclass(frozen=True)
class CollectiveCall:
    """One recorded collective: what every rank of its group must issue alike."""

    op: str  # all-reduce, all-gather, reduce-scatter
    axis: str  # the group: x, y, z, data, tensor (x*y*z) or all
    dtype: str
    shape: tuple[int, ...]  # the buffer the ledger counts
    nbytes: int


@dataclass
class CommLedger:
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    emulated: int = 0  # extra bytes moved by backend emulation (e.g. bf16 sent as fp32 on gloo)
    trace: list[CollectiveCall] | None = None  # kept where a caller sets a list; not reset

    def record(self, axis: str, nbytes: int, call: CollectiveCall | None = None) -> None:
        self.bytes[axis] += nbytes
        self.calls[axis] += 1
        if self.trace is not None and call is not None:
            self.trace.append(call)

    def snapshot(self) -> dict[str, int]:
        return {k: int(self.bytes.get(k, 0)) for k in LEDGER_KEYS}

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.emulated = 0


class Handle:
    """An in-flight collective. `wait()` returns its result tensor."""

    def __init__(self, comm: "Comm", work: object | None, result: torch.Tensor, op: str,
                 axis: str, finish: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._comm, self._work, self._result, self.op, self.axis = comm, work, result, op, axis
        self._finish = finish
        self._done = work is None

    def wait(self) -> torch.Tensor:
        if not self._done:
            try:
                self._work.wait()  # type: ignore[attr-defined]
            except RuntimeError as e:
                raise self._comm.error(self.op, self.axis, e) from None
            self._done = True
            if self._finish is not None:
                self._result = self._finish(self._result)
                self._finish = None
        return self._result


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older
# releases in our supported range only have the old ones. Looked up at each call, so that a
# count of what torch.distributed is handed (tests/dist_count.py) sees every call.
def _all_gather_tensor(out: torch.Tensor, t: torch.Tensor, group: object) -> object:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=group, async_op=True)


def _reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group: object) -> object:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, t, group=group, async_op=True)


_GLOO_NATIVE_16BIT = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def _wire_dtype(t: torch.Tensor, backend: str) -> torch.dtype:
    if backend == "gloo" and t.dtype in (torch.bfloat16, torch.float16) \
            and not _GLOO_NATIVE_16BIT:
        return torch.float32
    return t.dtype


class Comm:
    """Collectives over the grid's axes, with a byte ledger."""

    def __init__(self, grid: Grid, ledger: CommLedger | None = None) -> None:
        self.grid = grid
        self.ledger = ledger or CommLedger()

    def _members(self, axis: str) -> str:
        if axis not in ("x", "y", "z", "data"):
            return ""
        for ranks in self.grid.shape.axis_groups(axis):  # type: ignore[arg-type]
            if self.grid.rank in ranks:
                return f" (ranks {','.join(map(str, ranks))})"
        return ""

    def error(self, op: str, axis: str, cause: BaseException) -> CollectiveError:
        return CollectiveError(
            f"rank {self.grid.rank} (grid {self.grid.shape}): {op} over axis {axis}"
            f"{self._members(axis)} failed: "
            f"{first_line(cause)} "
            "(another rank probably died or hangs; see its log)")

    def _group(self, axis: str) -> object | None:
        if axis == "all":
            return self.grid.world_group
        if axis == "tensor":
            return self.grid.tensor_group
        return self.grid.group(axis)  # type: ignore[arg-type]

    def _size(self, axis: str) -> int:
        if axis == "all":
            return self.grid.world_size
        if axis == "tensor":
            return self.grid.shape.tensor_size
        return self.grid.size(axis)  # type: ignore[arg-type]

    def _record(self, ledger_axis: str, nbytes: int, axis: str, op: str,
                buffer: torch.Tensor) -> None:
        if self._size(axis) > 1:  # a one-rank group's collective moves nothing
            call = None if self.ledger.trace is None else CollectiveCall(
                op, axis, str(buffer.dtype).removeprefix("torch."), tuple(buffer.shape), nbytes)
            self.ledger.record(ledger_axis, nbytes, call)

    def _check_sizes(self, op: str, axis: str, group: object, whole: torch.Tensor,
                     part: torch.Tensor) -> None:
        """A gather's output (a scatter's input) must be the group's size times the part: a
        backend that moves no data (torch's fake group) does not check it, a real one fails or
        hangs."""
        size = dist.get_world_size(group)
        if size != self._size(axis) or whole.numel() != size * part.numel():
            raise CollectiveError(
                f"rank {self.grid.rank} (grid {self.grid.shape}): {op} over axis {axis}"
                f"{self._members(axis)}: {tuple(whole.shape)} is not {size} x "
                f"{tuple(part.shape)} (the group has {size} ranks, the grid's axis "
                f"{self._size(axis)})")

    @staticmethod
    def _cast(t: torch.Tensor, wire_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.dtype]:
        """`t` in the caller's wire dtype, and the dtype the result goes back to."""
        if wire_dtype is None or wire_dtype == t.dtype:
            return t, t.dtype
        return t.to(wire_dtype), t.dtype

    def _to_wire(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        wire = _wire_dtype(t, self.grid.backend)
        if wire != t.dtype:
            self.ledger.emulated += t.numel() * (torch.finfo(wire).bits - torch.finfo(t.dtype).bits) // 8
            return t.to(wire), t.dtype
        return t, t.dtype

    def all_reduce(self, t: torch.Tensor, axis: str, op: str = "sum",
                   async_op: bool = False, wire_dtype: torch.dtype | None = None) -> Handle:
        """Sum (or max) `t` over `axis` (sent as `wire_dtype` if given), in place: the result
        is t."""
        group = self._group(axis)
        if group is None:
            return Handle(self, None, t, "all-reduce", axis)
        source = t
        t, _ = self._cast(t, wire_dtype)
        self._record("all" if axis == "tensor" else axis, t.numel() * t.element_size(), axis,
                     "all-reduce", t)
        buf, _ = self._to_wire(t.contiguous())
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        try:
            work = dist.all_reduce(buf, op=reduce_op, group=group, async_op=True)
        except RuntimeError as e:
            raise self.error("all-reduce", axis, e) from None
        # the result goes back into the caller's tensor: no second buffer of its dtype where
        # the wire carried another (or a contiguous copy)
        handle = Handle(self, work, buf, "all-reduce", axis,
                        finish=(lambda r: source.copy_(r)) if buf is not source else None)
        if not async_op:
            handle.wait()
        return handle

    def all_gather(self, t: torch.Tensor, axis: str, async_op: bool = False) -> Handle:
        """Concatenate each rank's `t` along dim 0, in axis order."""
        # z's gathers (weight prefetch) have their own group: see Grid.gather_groups.
        group = self.grid.gather_group("z") if axis == "z" else self._group(axis)
        size = self._size(axis)
        if group is None:
            return Handle(self, None, t, "all-gather", axis)
        buf, dtype = self._to_wire(t.contiguous())
        out = torch.empty((size * t.shape[0], *t.shape[1:]), dtype=buf.dtype, device=t.device)
        self._check_sizes("all-gather", axis, group, out, buf)
        self._record(axis, out.numel() * t.element_size(), axis, "all-gather", out)
        try:
            work = _all_gather_tensor(out, buf, group)
        except RuntimeError as e:
            raise self.error("all-gather", axis, e) from None
        handle = Handle(self, work, out, "all-gather", axis,
                        finish=(lambda r: r.to(dtype)) if buf.dtype != dtype else None)
        if not async_op:
            handle.wait()
        return handle

    def all_gather_objects(self, obj: object, axis: str) -> list[object]:
        """Every rank's picklable `obj` over `axis`, in axis order (small things: reports)."""
        group = self._group(axis)
        if group is None:
            return [obj]
        out: list[object] = [None] * self._size(axis)
        try:
            dist.all_gather_object(out, obj, group=group)
        except RuntimeError as e:
            raise self.error("all-gather", axis, e) from None
        return out

    def reduce_scatter(self, t: torch.Tensor, axis: str, async_op: bool = False) -> Handle:
        """Sum `t` over `axis` and keep this rank's 1/size slice of dim 0 (in t's dtype)."""
        group = self._group(axis)
        size = self._size(axis)
        if group is None:
            return Handle(self, None, t, "reduce-scatter", axis)
        self._record(axis, t.numel() * t.element_size(), axis, "reduce-scatter", t)
        buf, dtype = self._to_wire(t.contiguous())
        out = torch.empty((t.shape[0] // size, *t.shape[1:]), dtype=buf.dtype, device=t.device)
        self._check_sizes("reduce-scatter", axis, group, buf, out)
        try:
            work = _reduce_scatter_tensor(out, buf, group)
        except RuntimeError as e:
            raise self.error("reduce-scatter", axis, e) from None
        handle = Handle(self, work, out, "reduce-scatter", axis,
                        finish=(lambda r: r.to(dtype)) if buf.dtype != dtype else None)
        if not async_op:
            handle.wait()
        return handle

