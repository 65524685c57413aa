"""How a full tensor is laid out over the grid.

A Layout says, for each tensor dim, which grid axes split it, outer first. The 3D linear weight
W[out, in] of a "normal" layer is `Layout(((y, z), (x,)))`: in is split over x; out over y, and
each y-block again over z (the depth axis). A transposed layer swaps x and y. Axes that split no
dim hold replicas. The checkpoint writer, the planner's memory model, gathering for tests and
the gradient norm all read the same Layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fourfold.parallel.grid import AXES, Axis, GridError, GridShape


@dataclass(frozen=True)
class Layout:
    dims: tuple[tuple[Axis, ...], ...]  # per tensor dim: the axes that split it, outer first

    @property
    def split_axes(self) -> tuple[Axis, ...]:
        return tuple(a for d in self.dims for a in d)

    def replicated_axes(self) -> tuple[Axis, ...]:
        return tuple(a for a in AXES if a not in self.split_axes)

    def replicas(self, shape: GridShape, tensor_axes_only: bool = True) -> int:
        """How many ranks hold each element (over x, y, z only by default)."""
        n = 1
        for a in self.replicated_axes():
            if tensor_axes_only and a == "data":
                continue
            n *= getattr(shape, a)
        return n

    def local_shape(self, full_shape: tuple[int, ...], shape: GridShape,
                    name: str = "tensor") -> tuple[int, ...]:
        out = []
        for dim, (size, axes) in enumerate(zip(full_shape, self._padded(len(full_shape)))):
            parts = 1
            for a in axes:
                parts *= getattr(shape, a)
            if size % parts:
                raise GridError(f"{name}: dim {dim} of size {size} is not divisible by "
                                f"{'*'.join(axes)} = {parts}")
            out.append(size // parts)
        return tuple(out)

    def _padded(self, ndim: int) -> tuple[tuple[Axis, ...], ...]:
        return self.dims + ((),) * (ndim - len(self.dims))

    def offsets(self, full_shape: tuple[int, ...], shape: GridShape,
                coords: dict[Axis, int]) -> tuple[int, ...]:
        """Start index of this rank's block in each dim."""
        local = self.local_shape(full_shape, shape)
        offs = []
        for size, axes in zip(local, self._padded(len(full_shape))):
            index = 0
            for a in axes:  # outer first
                index = index * getattr(shape, a) + coords[a]
            offs.append(index * size)
        return tuple(offs)

    def full_shape(self, local_shape: tuple[int, ...], shape: GridShape) -> tuple[int, ...]:
        """The full tensor's shape, from the shape of one rank's block."""
        out = []
        for size, axes in zip(local_shape, self._padded(len(local_shape))):
            for a in axes:
                size *= getattr(shape, a)
            out.append(size)
        return tuple(out)

    def block_index(self, full_shape: tuple[int, ...], shape: GridShape,
                    coords: dict[Axis, int]) -> tuple[slice, ...]:
        """The slices of the full tensor that this rank's block covers."""
        local = self.local_shape(full_shape, shape)
        offs = self.offsets(full_shape, shape, coords)
        return tuple(slice(o, o + n) for o, n in zip(offs, local))

    def shard(self, full: torch.Tensor, shape: GridShape, coords: dict[Axis, int]) -> torch.Tensor:
        """This rank's block of a full tensor (a copy, contiguous). Of a meta tensor, an
        empty meta tensor of the block's shape: cloning a meta view runs torch's Python meta
        kernel, which imports sympy and torch's symbolic shapes (about 30 MiB a process)."""
        block = full[self.block_index(tuple(full.shape), shape, coords)]
        if block.is_meta:
            return torch.empty(block.shape, dtype=block.dtype, device="meta")
        return block.clone().contiguous()


REPLICATED = Layout(())
