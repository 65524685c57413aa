"""The 3D tensor-parallel Linear and the fan-out op that feeds it.

A "normal" layer W[out, in] has `in` split over x and `out` over y; each (x, y) block is split
again over z along its rows. Its input is split over x (replicated over y); its output, after
the all-reduce over x, is split over y (replicated over x). A "transposed" layer swaps x and y,
so normal and transposed layers chain with no resharding: q/k/v then o, gate/up then down.

The fan-out op sits where one activation feeds one or more linears: identity in forward; in
backward it sums the partial input gradients over the linears' output axis, and runs the
deferred weight-gradient GEMMs while that all-reduce is in flight.
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold.parallel.engine import Engine
from fourfold.parallel.grid import Axis, Grid
from fourfold.parallel.layout import Layout


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _FanOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, engine: Engine, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.engine, ctx.axis = engine, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        engine: Engine = ctx.engine
        if engine.comm.grid.size(ctx.axis) == 1:
            engine.flush()
            return grad, None, None
        if engine.options.input_grad:
            handle = engine.comm.all_reduce(grad.contiguous().clone(), ctx.axis, async_op=True)
            engine.flush()  # dW GEMMs of the consumers run under the all-reduce
            return handle.wait(), None, None
        engine.flush()
        return engine.comm.all_reduce(grad.contiguous().clone(), ctx.axis).wait(), None, None


def fan_out(x: torch.Tensor, engine: Engine, axis: Axis) -> torch.Tensor:
    return _FanOut.apply(x, engine, axis)


class _Linear3DFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_shard: torch.Tensor,  # type: ignore[override]
                module: "Linear3D") -> torch.Tensor:
        engine = module.engine
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            w = engine.gather_weight(module, "forward")  # (out_local, in_local)
            y = engine.matmul("forward", x.to(dtype), w.to(dtype))  # partial sum over in_axis
            y = engine.comm.all_reduce(y, module.in_axis).wait()
        ctx.module, ctx.dtype, ctx.x_dtype = module, dtype, x.dtype
        # a frozen weight needs no dW, so its input is not kept for backward
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        module: Linear3D = ctx.module
        engine = module.engine
        (x,) = ctx.saved_tensors
        dtype = ctx.dtype
        grad_in = None
        with torch.autocast(grad_out.device.type, enabled=False):
            dy = grad_out.to(dtype)
            if ctx.needs_input_grad[0]:
                w = engine.gather_weight(module, "backward")
                # partial over out_axis; summed by the fan-out that produced x
                grad_in = engine.matmul("input_grad", dy, w.to(dtype)).to(ctx.x_dtype)

            def weight_grad() -> None:
                block = engine.matmul("weight_grad", dy, x.to(dtype))
                engine.reduce_scatter_weight_grad(module.weight, block.float())

            if x is not None:  # None: the weight is frozen (no GEMM, no reduce-scatter)
                engine.defer(weight_grad)
        return grad_in, None, None


class Linear3D(nn.Module):
    """A linear layer of the 3D parallel matrix multiply (normal or transposed)."""

    def __init__(self, linear: nn.Linear, grid: Grid, engine: Engine, transposed: bool,
                 own_fan_out: bool, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.in_axis: Axis = "y" if transposed else "x"
        self.out_axis: Axis = "x" if transposed else "y"
        self.transposed = transposed
        self.own_fan_out = own_fan_out
        self.engine = engine
        self.in_features, self.out_features = linear.in_features, linear.out_features
        shape, coords = grid.shape, grid.shape.coords(grid.rank)
        self.weight_layout = Layout(((self.out_axis, "z"), (self.in_axis,)))
        self.bias_layout = Layout(((self.out_axis,),))
        name = f"Linear({self.in_features}->{self.out_features})"
        local = self.weight_layout.local_shape(tuple(linear.weight.shape), shape, name)
        self.block_shape = (local[0] * grid.size("z"), local[1])
        self.needs_backward_gather = True
        # a shard keeps its full tensor's requires_grad: frozen stays frozen
        self.weight = weight if weight is not None else nn.Parameter(
            self.weight_layout.shard(linear.weight.detach(), shape, coords),
            requires_grad=linear.weight.requires_grad)
        if linear.bias is not None:
            self.bias: nn.Parameter | None = nn.Parameter(
                self.bias_layout.shard(linear.bias.detach(), shape, coords),
                requires_grad=linear.bias.requires_grad)
        else:
            self.register_parameter("bias", None)
        engine.register(self)

    @torch.compiler.disable  # collectives and deferred GEMMs: compiled code runs around it
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_fan_out:
            x = fan_out(x, self.engine, self.out_axis)
        y = _Linear3DFunction.apply(x, self.weight, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        kind = "transposed" if self.transposed else "normal"
        return f"{self.in_features}->{self.out_features}, {kind}, block={self.block_shape}"


class _SplitLastDim(torch.autograd.Function):
    """Keep this rank's slice of the last dim; backward all-gathers the gradient slices."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        size, index = comm.grid.size(axis), comm.grid.coord(axis)
        ctx.comm, ctx.axis = comm, axis
        n = x.shape[-1] // size
        return x[..., index * n:(index + 1) * n].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _gather_last_dim(grad, ctx.comm, ctx.axis), None, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather the last dim over an axis; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.axis = comm, axis
        return _gather_last_dim(x, comm, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        size, index = ctx.comm.grid.size(ctx.axis), ctx.comm.grid.coord(ctx.axis)
        n = grad.shape[-1] // size
        return grad[..., index * n:(index + 1) * n].contiguous(), None, None


def _gather_last_dim(x: torch.Tensor, comm, axis: str) -> torch.Tensor:
    size = comm.grid.size(axis)
    if size == 1:
        return x
    moved = x.movedim(-1, 0).contiguous()  # (n, ...)
    gathered = comm.all_gather(moved, axis).wait()  # (size * n, ...)
    return gathered.movedim(0, -1).contiguous()


class ReplicatedLinear3D(Linear3D):
    """A 3D linear for models whose activation layout fourfold does not know: input and output
    are whole (replicated over x and y); the layer slices its input over x, runs the normal 3D
    layer, and all-gathers its output over y. Correct for any module; the model-specific plans
    avoid the extra gather and slice."""

    def __init__(self, linear: nn.Linear, grid: Grid, engine: Engine) -> None:
        super().__init__(linear, grid, engine, transposed=False, own_fan_out=True)

    @torch.compiler.disable  # as Linear3D.forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _SplitLastDim.apply(x, self.engine.comm, "x")
        y = super().forward(x)
        return _GatherLastDim.apply(y, self.engine.comm, "y")
