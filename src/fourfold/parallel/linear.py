"""The 3D tensor-parallel Linear and the fan-out op that feeds it.

A "normal" layer W[out, in] has `in` split over x and `out` over y; each (x, y) block is split
again over z along its rows. Its input is split over x (replicated over y); its output, after
the all-reduce over x, is split over y (replicated over x). A "transposed" layer swaps x and y,
so normal and transposed layers chain with no resharding: q/k/v then o, gate/up then down.

The fan-out op sits where one activation feeds one or more linears: identity in forward; in
backward it sums the partial input gradients over the linears' output axis, and runs the
deferred weight-gradient GEMMs while that all-reduce is in flight. The gradients travel in the
compute dtype of the forward (bfloat16 under autocast: the GEMMs that made them ran in it),
even where the activation itself is float32 (the residual stream).

A layer whose input is a cheap function of tensors autograd keeps anyway (down's input,
silu(gate) * up, of gate and up, which SwiGLU keeps) can be handed that recipe
(`Linear3D.forward(x, recompute=(fn, inputs))`): it keeps the inputs instead of x and
recomputes x for its weight gradient, so x's storage is freed after the forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from fourfold.parallel.engine import Engine, keeps_output_block
from fourfold.parallel.grid import Axis, Grid
from fourfold.parallel.layout import Layout

T = TypeVar("T", bound=Callable)


def eager_only(fn: T) -> T:
    """fn, run eagerly inside a compiled region (torch.compiler.disable: a graph break, the
    compiled code runs around it) and called as it is outside one. torch.compiler.disable is
    made at the first compiled call (torch's lazy form): making it, or calling it, imports
    torch._dynamo, about 70 MiB resident and a second in every process, which only a run that
    compiles (train.compile) needs."""
    lazy = getattr(torch, "_disable_dynamo", None)
    disabled = lazy(fn) if lazy is not None else torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # a constant True while dynamo traces
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's GEMMs run in: autocast's when it is on, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def holds_result(out: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether `out.op_(other)` gives the tensor `out op other` would (its dtype and shape, with
    `other` broadcast): the memory-lean forwards write a product or sum into one operand where
    it does, one activation-sized temporary less (see models/llama.py's _Rope). The shapes
    are compared here, not by torch.broadcast_shapes, which imports torch._refs and sympy
    (30 MiB and more in every process)."""
    if out.dtype != torch.result_type(out, other) or other.dim() > out.dim():
        return False
    return all(o in (1, n) for o, n in zip(reversed(other.shape), reversed(out.shape)))


class _FanOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, engine: Engine, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.engine, ctx.axis, ctx.wire_dtype = engine, axis, compute_dtype(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        engine: Engine = ctx.engine
        if engine.comm.grid.size(ctx.axis) == 1:
            engine.flush()
            return grad, None, None
        if engine.options.input_grad:
            handle = engine.comm.all_reduce(grad.contiguous().clone(), ctx.axis, async_op=True,
                                            wire_dtype=ctx.wire_dtype)
            engine.flush()  # dW GEMMs of the consumers run under the all-reduce
            return handle.wait(), None, None
        engine.flush()
        return engine.comm.all_reduce(grad.contiguous().clone(), ctx.axis,
                                      wire_dtype=ctx.wire_dtype).wait(), None, None


def fan_out(x: torch.Tensor, engine: Engine, axis: Axis) -> torch.Tensor:
    return _FanOut.apply(x, engine, axis)


def split_rows(n: int) -> tuple[int, int]:
    """How overlap_forward splits n tokens: the first half takes the odd one."""
    return (n + 1) // 2, n // 2


def _forward_gemm(engine: Engine, x: torch.Tensor, w: torch.Tensor, axis: str) -> torch.Tensor:
    """x W^T summed over `axis`. With overlap_forward, in two halves of the tokens: the first
    half's all-reduce is in flight while the second half's GEMM runs."""
    if not engine.options.forward_split or engine.comm.grid.size(axis) == 1:
        return engine.comm.all_reduce(engine.matmul("forward", x, w), axis).wait()
    rows = x.reshape(-1, x.shape[-1])
    first, second = split_rows(rows.shape[0])
    if second == 0:
        return engine.comm.all_reduce(engine.matmul("forward", x, w), axis).wait()
    handle = engine.comm.all_reduce(engine.matmul("forward", rows[:first], w), axis,
                                    async_op=True)
    rest = engine.comm.all_reduce(engine.matmul("forward", rows[first:], w), axis,
                                  async_op=True)
    y = torch.cat([handle.wait(), rest.wait()])
    return y.view(*x.shape[:-1], y.shape[-1])


# x = fn(*inputs): see the module docstring
Recompute = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]


class _Linear3DFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_shard: torch.Tensor,  # type: ignore[override]
                module: "Linear3D", recompute: Recompute | None = None) -> torch.Tensor:
        engine = module.engine
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            w = engine.gather_weight(module, "forward", dtype)  # (out_local, in_local)
            xc = x.to(dtype)  # what the GEMMs read, and what backward keeps (see below)
            # partial sums over in_axis, all-reduced
            y = _forward_gemm(engine, xc, w.to(dtype), module.in_axis)
        ctx.module, ctx.dtype, ctx.x_dtype = module, dtype, x.dtype
        ctx.kept_block = None
        if engine.is_last(module) and engine.comm.grid.size("z") > 1 and keeps_output_block(
                w.numel() * w.element_size(), y.numel() * y.element_size(), y.numel()):
            ctx.kept_block = w  # its backward comes next: no second gather
        # a frozen weight needs no dW, so its input is not kept for backward; a trainable one's
        # is kept in the compute dtype, which the dW GEMM reads (under autocast a float32
        # residual-stream input is kept at half its bytes and not cast again in backward)
        ctx.recompute_fn = None
        if not ctx.needs_input_grad[1]:
            ctx.save_for_backward(None)
        elif recompute is not None:
            ctx.recompute_fn = recompute[0]
            ctx.save_for_backward(*recompute[1])
        else:
            ctx.save_for_backward(xc)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        module: Linear3D = ctx.module
        engine = module.engine
        saved = ctx.saved_tensors
        x = ctx.recompute_fn(*saved) if ctx.recompute_fn is not None else saved[0]
        dtype = ctx.dtype
        grad_in = None
        with torch.autocast(grad_out.device.type, enabled=False):
            # gathered even when no input gradient is needed: the engine's prefetch order
            # and kept blocks expect every backward to take its block
            w = engine.gather_weight(module, "backward", dtype, kept=ctx.kept_block)
            ctx.kept_block = None
            dy = grad_out.to(dtype)
            if ctx.needs_input_grad[0]:
                # partial over out_axis; summed by the fan-out that produced x
                grad_in = engine.matmul("input_grad", dy, w.to(dtype)).to(ctx.x_dtype)

            def weight_grad() -> None:
                block = engine.matmul("weight_grad", dy, x.to(dtype))  # kept in dtype: no copy
                engine.reduce_scatter_weight_grad(module.weight, block)

            if x is not None:  # None: the weight is frozen (no GEMM, no reduce-scatter)
                engine.defer(weight_grad)
        return grad_in, None, None, None


class Linear3D(nn.Module):
    """A linear layer of the 3D parallel matrix multiply (normal or transposed)."""

    recomputes_input = True  # forward takes `recompute` (see the module docstring)

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

        self.fused: FusedLinears | None = None  # set by FusedLinears

    def gather_shard(self, compute_dtype: torch.dtype) -> torch.Tensor:
        """What this rank hands to the z all-gather: its shard in the GEMM's dtype."""
        return self.weight.detach().to(compute_dtype)

    def arrange(self, gathered: torch.Tensor) -> torch.Tensor:
        return gathered.view(self.block_shape)

    @eager_only  # collectives and deferred GEMMs: compiled code runs around it
    def forward(self, x: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.output(self, x)
        if self.own_fan_out:
            x = fan_out(x, self.engine, self.out_axis)
        y = _Linear3DFunction.apply(x, self.weight, self, recompute)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        kind = "transposed" if self.transposed else "normal"
        return f"{self.in_features}->{self.out_features}, {kind}, block={self.block_shape}"


class FusedLinears:
    """Normal linears that read the same input (q, k, v; gate, up) run as one: one z
    all-gather of their shards side by side, one GEMM, one output all-reduce, one dW GEMM and
    one reduce-scatter. Each keeps its own weight (state dicts, checkpoints and HF conversion
    see separate tensors). The first member called with an input computes every member's
    output; the others, called with the same tensor, take theirs."""

    def __init__(self, members: list[Linear3D]) -> None:
        first = members[0]
        for m in members:
            if m.transposed != first.transposed or m.in_features != first.in_features \
                    or m.own_fan_out or m.fused is not None:
                raise ValueError(f"cannot fuse {m} with {first}")
        self.members = members
        self.engine = first.engine
        self.in_axis, self.out_axis = first.in_axis, first.out_axis
        self.rows = [m.block_shape[0] for m in members]  # gathered rows of each
        self.block_shape = (sum(self.rows), first.block_shape[1])
        self.needs_backward_gather = True
        self._input: torch.Tensor | None = None
        self._outputs: dict[int, torch.Tensor] = {}
        for m in members:
            m.fused = self
        self.engine.at_begin_forward(self.clear)  # never hold a previous pass's outputs

    def gather_shard(self, compute_dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([m.weight.detach().to(compute_dtype) for m in self.members])

    def arrange(self, gathered: torch.Tensor) -> torch.Tensor:
        """(z * sum of shard rows, in) rank by rank -> every member's block, one after another."""
        z = self.engine.comm.grid.size("z")
        if z == 1:
            return gathered
        by_rank = gathered.view(z, -1, gathered.shape[-1])
        shard_rows = [r // z for r in self.rows]
        return torch.cat([part.reshape(-1, gathered.shape[-1])
                          for part in by_rank.split(shard_rows, dim=1)])

    def output(self, member: Linear3D, x: torch.Tensor) -> torch.Tensor:
        i = self.members.index(member)
        if self._input is x and i in self._outputs:
            y = self._outputs.pop(i)
            if not self._outputs:
                self._input = None
            return y
        ys = _FusedLinear3DFunction.apply(x, self, *[m.weight for m in self.members])
        ys = [y + m.bias.to(y.dtype) if m.bias is not None else y
              for y, m in zip(ys, self.members)]
        self._input, self._outputs = x, {j: y for j, y in enumerate(ys) if j != i}
        return ys[i]

    def clear(self) -> None:
        self._input, self._outputs = None, {}


class _FusedLinear3DFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: FusedLinears,  # type: ignore[override]
                *weight_shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        engine = group.engine
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            w = engine.gather_weight(group, "forward", dtype)  # (sum of out_local, in_local)
            xc = x.to(dtype)
            y = _forward_gemm(engine, xc, w.to(dtype), group.in_axis)
        ctx.group, ctx.dtype, ctx.x_dtype = group, dtype, x.dtype
        # frozen members need no dW: with all of them frozen the input is not kept; else it is
        # kept in the compute dtype, as Linear3D's
        ctx.save_for_backward(xc if any(ctx.needs_input_grad[2:]) else None)
        return tuple(y.split(group.rows, dim=-1))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        group: FusedLinears = ctx.group
        engine = group.engine
        (x,) = ctx.saved_tensors
        dtype = ctx.dtype
        some = next(g for g in grads if g is not None)  # x is None when all members are frozen
        with torch.autocast(some.device.type, enabled=False):
            w = engine.gather_weight(group, "backward", dtype)
            dy = torch.cat([torch.zeros((*some.shape[:-1], r), dtype=dtype, device=some.device)
                            if g is None else g.to(dtype) for g, r in zip(grads, group.rows)],
                           dim=-1)
            grad_in = (engine.matmul("input_grad", dy, w.to(dtype)).to(ctx.x_dtype)
                       if ctx.needs_input_grad[0] else None)
            trainable = list(ctx.needs_input_grad[2:])

            def weight_grad() -> None:
                if all(trainable):
                    block = engine.matmul("weight_grad", dy, x)
                    blocks = list(block.split(group.rows))
                    params = [m.weight for m in group.members]
                else:  # only the trainable members' rows: a frozen weight runs no dW GEMM
                    rows = dy.split(group.rows, dim=-1)
                    blocks = [engine.matmul("weight_grad", d.contiguous(), x)
                              for d, t in zip(rows, trainable) if t]
                    params = [m.weight for m, t in zip(group.members, trainable) if t]
                engine.reduce_scatter_weight_grads(params, blocks)

            if any(trainable):
                engine.defer(weight_grad)
        return (grad_in, None) + (None,) * len(group.members)


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

    recomputes_input = False  # its GEMM's input is a slice of x, not x

    def __init__(self, linear: nn.Linear, grid: Grid, engine: Engine) -> None:
        super().__init__(linear, grid, engine, transposed=False, own_fan_out=True)

    @eager_only  # as Linear3D.forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _SplitLastDim.apply(x, self.engine.comm, "x")
        y = super().forward(x)
        return _GatherLastDim.apply(y, self.engine.comm, "y")
