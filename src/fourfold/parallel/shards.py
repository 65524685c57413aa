"""Whole tensors that no rank holds: materialising a meta-device model shard by shard, and
streaming full tensors to one rank, one tensor at a time.

Materialising: a model declared on the meta device is parallelized as any other (the shards it
cuts are meta too); then each rank asks the model for the initial value of just the block of
each tensor it owns. The model answers through `initial_block` (see `ShardInitializer`), whose
values must not depend on the grid, so every grid starts from the weights one process builds.

Streaming: the owners of a tensor's blocks (one rank per distinct block: coordinate 0 on the
axes that replicate it) send them to the destination rank, which assembles the full tensor on
the CPU. Peak memory there is about the largest tensor; the other ranks send from their
parameters and hold nothing extra.

While the destination writes a tensor (as long as its file system takes), no other rank may
have a collective waiting on it: a send, or whatever a rank would queue after its last one,
is failed by the backend's timeout (NCCL's watchdog aborts the job) once a write outlasts
parallel.timeout_s. So every hand-off waits outside the backend, on the job's key-value store
(`WriterHandoff`): the owners of tensor i send once the destination has written tensor i - 1,
and every rank leaves the stream once the destination has written the last one (and closed
and renamed its file: safetensors_stream.write_streamed ends the stream after that), through
a barrier that no one waits at for long. The
destination receives the next tensor only after writing the last, so its memory stays at one
tensor; an acknowledgement or a barrier through the backend would itself be a collective
waiting on the write.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import detect_fake_mode

from fourfold.parallel.comm import CollectiveError
from fourfold.parallel.grid import Grid, GridError
from fourfold.parallel.layout import REPLICATED, Layout
from fourfold.safetensors_stream import TensorSpec


class ShardInitializer(Protocol):
    def initial_block(self, name: str, full_shape: tuple[int, ...],
                      index: tuple[slice, ...]) -> torch.Tensor:
        """Block `index` of parameter `name`'s initial value (full shape `full_shape`)."""
        ...


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


@torch.no_grad()
def materialize(module: nn.Module, layouts: dict[str, Layout], grid: Grid) -> None:
    """Replace every meta parameter of a parallelized `module` by this rank's block of its
    initial value, on grid.device, keeping the Parameter objects (the engine and tied layers
    hold them); then move the buffers there too."""
    meta = [(n, p) for n, p in module.named_parameters() if p.is_meta]
    if not meta:
        return
    init = getattr(module, "initial_block", None)
    if init is None:
        raise GridError(f"parameter {meta[0][0]} is on the meta device, and "
                        f"{type(module).__name__} has no initial_block method to compute its "
                        "shards; build the model on a real device")
    shape, coords = grid.shape, grid.shape.coords(grid.rank)
    # under fake tensors (fourfold.simulate) a shard has a shape and no values: computing its
    # initial values tile by tile would only cost thousands of operators per parameter
    fake = detect_fake_mode() is not None
    for name, p in meta:
        layout = layouts.get(name, REPLICATED)
        full = layout.full_shape(tuple(p.shape), shape)
        block = (torch.empty(layout.local_shape(full, shape)) if fake
                 else init(name, full, layout.block_index(full, shape, coords)))
        real = nn.Parameter(block.to(device=grid.device, dtype=p.dtype),
                            requires_grad=p.requires_grad)
        if fake or weakref.getweakrefs(real) or weakref.getweakrefs(p):
            # fake tensors (a simulated rank, fourfold.simulate) are weakly referenced by their
            # mode, which swap_tensors refuses: every module holding p is given the new one
            _rebind(module, p, real)
        else:
            torch.utils.swap_tensors(p, real)
    # the buffers (parameters are there already; module.to would also swap each parameter,
    # which a fake one refuses)
    for owner in module.modules():
        for key, buffer in owner._buffers.items():
            if buffer is not None and buffer.device != grid.device:
                owner._buffers[key] = buffer.to(grid.device)


def _rebind(module: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    for owner in module.modules():
        for key, value in list(owner._parameters.items()):
            if value is old:
                owner._parameters[key] = new


def full_specs(module: nn.Module, layouts: dict[str, Layout], grid: Grid) -> list[TensorSpec]:
    """Name, dtype and full shape of every parameter (each shared tensor once) and persistent
    buffer, in the order `stream_full` sends them. No communication."""
    out = [TensorSpec(n, p.dtype, layouts.get(n, REPLICATED).full_shape(tuple(p.shape),
                                                                        grid.shape))
           for n, p in module.named_parameters()]
    return out + [TensorSpec(n, b.dtype, tuple(b.shape)) for n, b in _persistent_buffers(module)]


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    buffers = dict(module.named_buffers())
    return [(n, t) for n, t in module.state_dict(keep_vars=True).items() if n in buffers]


def stream_full(module: nn.Module, layouts: dict[str, Layout], grid: Grid, dst: int = 0
                ) -> Iterator[tuple[TensorSpec, torch.Tensor | None]]:
    """Each full tensor of `full_specs`, one at a time: on rank `dst` the whole tensor on the
    CPU, on the other ranks None. Collective: every rank must run the iterator to its end; on
    rank `dst` the caller's work between two items (writing the tensor) is waited for by the
    others outside the backend (see the module docstring)."""
    shape = grid.shape
    specs = full_specs(module, layouts, grid)
    if grid.world_size == 1:
        for spec, tensor in zip(specs, _tensors(module)):
            yield spec, tensor.detach().to("cpu")
        return
    handoff = WriterHandoff(grid, dst)
    written = -1  # the last tensor rank dst has written
    try:
        for i, (spec, tensor) in enumerate(zip(specs, _tensors(module))):
            layout = layouts.get(spec.name, REPLICATED)
            out = torch.empty(spec.shape, dtype=spec.dtype) if grid.rank == dst else None
            split = layout.split_axes
            ranges = [range(getattr(shape, a)) if a in split else range(1) for a in _AXIS_ORDER]
            for values in itertools.product(*ranges):
                coords = dict(zip(_AXIS_ORDER, values))
                owner = shape.rank_of(coords)
                index = layout.block_index(spec.shape, shape, coords)
                if owner == grid.rank == dst:
                    out[index] = tensor.detach().cpu()  # type: ignore[index]
                elif grid.rank == owner:
                    handoff.wait_written(i - 1)
                    dist.send(tensor.detach().contiguous(), dst)
                elif grid.rank == dst:
                    block = torch.empty(tuple(s.stop - s.start for s in index),
                                        dtype=spec.dtype, device=grid.device)
                    dist.recv(block, owner)
                    out[index] = block.cpu()  # type: ignore[index]
                    del block
            yield spec, out
            del out  # before the next tensor is allocated: one full tensor at a time
            if grid.rank == dst:
                handoff.written(i)
            written = i
        handoff.finish(len(specs) - 1)
    finally:
        if grid.rank == dst and written < len(specs) - 1:
            handoff.abandon(written + 1, len(specs))  # the writer failed: no one waits on


class WriterHandoff:
    """The hand-offs of a streamed export between its writer (rank `dst`) and the other
    ranks, through the job's key-value store (the one torch.distributed met through): the
    writer marks each tensor written; a rank waits for a mark as long as the writer takes,
    since the wait is no collective that a timeout fails. The export ends with a barrier once
    every rank has seen the last mark (quick then: no one waits on a write any more), so that
    the writer, which may serve the store, outlives the others' last look at it. If the writer
    stops early it marks the rest abandoned and the waiting ranks raise; a writer that dies
    ends the job through its launcher (torchrun stops every rank) or the store it served."""

    def __init__(self, grid: Grid, dst: int) -> None:
        self.grid, self.dst = grid, dst
        # a simulated rank (torch's fake process group, fourfold.simulate) is alone: no writer
        # in another process to wait for, and no store behind the group
        self.store = None if grid.simulated else \
            dist.distributed_c10d._get_default_store()
        # every rank runs every export, so each one's count of them names this one alike
        count = 0 if self.store is None else \
            self.store.add(f"fourfold/exports/rank{grid.rank}", 1)
        self.prefix = f"fourfold/export{count}"

    def written(self, index: int) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/{index}", "written")

    def abandon(self, first: int, end: int) -> None:
        if self.store is None:
            return
        for index in range(first, end):
            self.store.set(f"{self.prefix}/{index}", "abandoned")

    def wait_written(self, index: int) -> None:
        """Wait until the writer has written tensor `index` (-1: nothing to wait for)."""
        if index < 0 or self.grid.rank == self.dst or self.store is None:
            return
        stopped = (f"rank {self.grid.rank}: the streamed export's writer (rank {self.dst}) "
                   f"stopped at tensor {index}")
        while True:
            try:
                # waits for the key up to the store's timeout; the writer may take longer
                mark = self.store.get(f"{self.prefix}/{index}")
                break
            except dist.DistStoreError:  # the store's timeout ran out: still writing
                continue
            except dist.DistNetworkError:  # the store went with the writer's process
                raise CollectiveError(f"{stopped} and is gone; see its log") from None
        if mark != b"written":
            raise CollectiveError(f"{stopped}; see its log")

    def finish(self, last: int) -> None:
        """Every rank: wait until the writer has written tensor `last`, then meet."""
        self.wait_written(last)
        dist.barrier()


_AXIS_ORDER = ("data", "z", "y", "x")


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    for _, p in module.named_parameters():
        yield p
    for _, b in _persistent_buffers(module):
        yield b
