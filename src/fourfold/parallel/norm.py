"""RMSNorm over features split across the x axis: the sum of squares is all-reduced over x."""

from __future__ import annotations

import torch
from torch import nn

from fourfold.parallel.comm import all_reduce_both_ways
from fourfold.parallel.engine import Engine
from fourfold.parallel.grid import Grid
from fourfold.parallel.layout import Layout
from fourfold.parallel.linear import fan_out


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
        dtype = x.dtype
        xf = x.float()
        sumsq = all_reduce_both_ways(xf.pow(2).sum(-1, keepdim=True), self.engine.comm, "x")
        y = self.weight * (xf * torch.rsqrt(sumsq / self.full_dim + self.eps)).to(dtype)
        if self.fan_out_to_y:
            y = fan_out(y, self.engine, "y")
        return y
