"""RMSNorm over features split across the x axis: the sum of squares is all-reduced over x;
rms_norm is the memory-lean function that the one-process model uses too."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fourfold.parallel.engine import Engine
from fourfold.parallel.grid import Grid
from fourfold.parallel.layout import Layout
from fourfold.parallel.linear import fan_out, holds_result


Reduce = Callable[[torch.Tensor], torch.Tensor]


class _RMSNorm(torch.autograd.Function):
    """y = w * x / rms(x), where rms's sum of squares runs over the last dimension, summed by
    `reduce` (None: the features are all here; on a grid, an all-reduce over x) in forward, as
    is its gradient (a per-token scalar) in backward.

    Saves only x, w and the per-token 1/rms: the normalized x that autograd's weight multiply
    would keep (one more residual-sized tensor per norm, two per block: 9% of a 350m block's
    saved activations) is recomputed in backward, one multiply. The backward is autograd's own
    chain for these ops, in the same order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,  # type: ignore[override]
                full_dim: int, reduce: Reduce | None) -> torch.Tensor:
        xf = x.float()
        # the sum of squares as a reduction and the product in place: no x-sized temporary
        # (see models/llama.py's _Rope: each would be a hole in a CPU process's heap)
        sumsq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square()
        if reduce is not None:
            sumsq = reduce(sumsq)
        rstd = torch.rsqrt(sumsq / full_dim + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.full_dim, ctx.reduce = full_dim, reduce
        normed = (xf * rstd).to(x.dtype)
        if holds_result(normed, weight):
            return normed.mul_(weight)
        return weight * normed

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (dy * (xf * rstd).to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
        if not ctx.needs_input_grad[0]:  # e.g. the first norm of a frozen embedding: no dx,
            return None, dw, None, None, None  # so no all-reduce either (the planner's count)
        dnormed = (dy * weight).to(x.dtype).float()
        dsumsq = (dnormed * xf).sum(-1, keepdim=True) * (-0.5 * rstd.pow(3)) / ctx.full_dim
        if ctx.reduce is not None:
            dsumsq = ctx.reduce(dsumsq)
        dx = dnormed * rstd + dsumsq * (2.0 * xf)
        return dx.to(x.dtype), dw, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, full_dim: int | None = None,
             reduce: Reduce | None = None) -> torch.Tensor:
    """RMSNorm of x's last dimension (`full_dim` features in all, of which x holds its part
    when `reduce` sums a per-token statistic over the ranks that hold the rest)."""
    return _RMSNorm.apply(x, weight, eps, full_dim or x.shape[-1], reduce)


class ParallelRMSNorm(nn.Module):
    """RMSNorm of a residual stream split over x (replicated over y).

    With `fan_out_to_y`, the output feeds normal linears (q/k/v, gate/up, the output layer),
    and this module's fan-out sums their input gradients over y once for all of them.
    """

    layout = Layout((("x",),))

    def __init__(self, weight: torch.Tensor, eps: float, grid: Grid, engine: Engine,
                 fan_out_to_y: bool) -> None:
        super().__init__()
        self.full_dim = weight.shape[0]
        self.eps = eps
        self.engine = engine
        self.fan_out_to_y = fan_out_to_y
        local = self.layout.shard(weight.detach(), grid.shape, grid.shape.coords(grid.rank))
        self.weight = nn.Parameter(local, requires_grad=weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.engine.comm
        y = rms_norm(x, self.weight, self.eps, self.full_dim,
                     lambda t: comm.all_reduce(t, "x").wait())
        if self.fan_out_to_y:
            y = fan_out(y, self.engine, "y")
        return y
