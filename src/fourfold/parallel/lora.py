"""LoRA factors beside a linear layer, on one process (nn.Linear) or on the grid (Linear3D).

For W[out, in], y = base(x) + (alpha / r) * B(A(dropout(x))) with A[r, in] and B[out, r]. On the
grid A is split like the layer's input dimension (over its in_axis) and B like its output
dimension (over its out_axis); both are replicated over the other tensor axis, over z and over
data. The forward x @ A^T is a partial sum over in_axis (one all-reduce of a tokens x r tensor);
in backward, dL/dh = dy @ B is a partial sum over out_axis (its twin). Why no other sums:
the gradient arriving at the output is already whole on every in_axis replica (the fan-out
convention of linear.py), so B's gradient is complete per batch shard; A's uses the summed
dL/dh. Both are then summed over the batch axes z and data by the engine, like every parameter
not split over z.

The factors start from one seed on global shapes (A kaiming-uniform as in peft, B zeros) and
each rank keeps its slice, so every grid starts from the same adapter. The base layer is
frozen. Nothing here knows what the layer is for.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
from torch import nn

from fourfold.parallel.comm import Comm
from fourfold.parallel.grid import Axis
from fourfold.parallel.layout import Layout
from fourfold.parallel.linear import Linear3D, ReplicatedLinear3D, compute_dtype, eager_only


class LoRAError(ValueError):
    """A LoRA setting that cannot work for this layer; the message is one line for the user."""


@dataclass(frozen=True)
class LoRASpec:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.r


@dataclass
class ForwardCounter:
    """Counts forward passes of a model (not recomputations under activation checkpointing),
    so that dropout masks are the same in a recompute and on every replica of an input."""

    count: int = 0

    def tick(self, *_: object) -> None:
        self.count += 1


class LoRAFactor(nn.Module):
    """One factor (A or B): this rank's block as `weight`, and its Layout over the grid."""

    def __init__(self, local: torch.Tensor, layout: Layout) -> None:
        super().__init__()
        self.weight = nn.Parameter(local)
        self.layout = layout

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, split {self.layout.dims}"


class _LoRAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,  # type: ignore[override]
                hook: "LoRAHook") -> torch.Tensor:
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc, ac, bc = x.to(dtype), a.to(dtype), b.to(dtype)
            h = xc @ ac.t()  # (..., r), partial over in_axis
            if hook.comm is not None:
                h = hook.comm.all_reduce(h, hook.in_axis).wait()
            y = (h @ bc.t()) * hook.spec.scale
        ctx.save_for_backward(xc, ac, bc, h)
        ctx.hook, ctx.x_dtype = hook, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        hook: LoRAHook = ctx.hook
        x, a, b, h = ctx.saved_tensors
        scale = hook.spec.scale
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.to(x.dtype)
            dh = (dy @ b) * scale  # partial over out_axis
            grad_b = (dy.reshape(-1, dy.shape[-1]).t() @ h.reshape(-1, h.shape[-1])) * scale
            dh_full = dh
            if hook.comm is not None:
                dh_full = hook.comm.all_reduce(dh.contiguous().clone(), hook.out_axis).wait()
            grad_a = dh_full.reshape(-1, dh.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            grad_x = None
            if ctx.needs_input_grad[0]:
                # A layer whose input fan-out sits upstream gets the partial input gradient, as
                # the base layer's own; the fan-out sums both over out_axis. A layer that owns
                # its fan-out receives x before it, so it needs the whole gradient.
                grad_x = ((dh_full if hook.whole_input_grad else dh) @ a).to(ctx.x_dtype)
        return grad_x, grad_a.to(a.dtype), grad_b.to(b.dtype), None


@dataclass(eq=False)
class LoRAHook:
    """The forward hook that adds the LoRA term to a linear layer's output."""

    spec: LoRASpec
    name: str
    seed: int
    counter: ForwardCounter
    comm: Comm | None = None
    in_axis: Axis = "x"
    out_axis: Axis = "y"
    whole_input_grad: bool = False
    mask_key: tuple[int, ...] = field(default=())  # grid coordinates that change the input

    @eager_only  # collectives inside, as Linear3D.forward
    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if self.spec.dropout > 0 and module.training:
            x = self._dropout(x)
        lora_a, lora_b = module.lora_A, module.lora_B  # type: ignore[attr-defined]
        return output + _LoRAFunction.apply(x, lora_a.weight, lora_b.weight, self).to(output.dtype)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Keyed by layer, forward pass and the input's grid position: replicas of an input
        # (ranks along out_axis) drop the same features, and a recompute the same as before.
        key = f"{self.seed}:{self.name}:{self.counter.count}:{self.mask_key}".encode()
        g = torch.Generator(device=x.device).manual_seed(zlib.crc32(key))
        keep = torch.rand(x.shape, generator=g, device=x.device) >= self.spec.dropout
        return x * keep.to(x.dtype) / (1.0 - self.spec.dropout)


def global_init(name: str, out_features: int, in_features: int, spec: LoRASpec, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full A (r, in), kaiming-uniform with a = sqrt(5) as peft does, and B (out, r) zeros;
    the same for a layer name and seed on every process and grid."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)): gain^2 = 1/3
    a = (torch.rand(spec.r, in_features, generator=g, dtype=torch.float64) * 2 - 1) * bound
    return a.float(), torch.zeros(out_features, spec.r)


def add_lora(module: nn.Module, name: str, spec: LoRASpec, seed: int, counter: ForwardCounter
             ) -> LoRAHook:
    """Freeze `module` (an nn.Linear or a Linear3D) and add LoRA factors `lora_A`, `lora_B`
    beside it; `name` (its qualified name) keys the initialisation."""
    if isinstance(module, ReplicatedLinear3D):
        raise LoRAError(f"{name}: LoRA needs the Llama-family plan; this layer runs under the "
                        "generic plan (whole inputs and outputs)")
    if isinstance(module, Linear3D):
        in_f, out_f = module.in_features, module.out_features
    elif isinstance(module, nn.Linear):
        in_f, out_f = module.in_features, module.out_features
    else:
        raise LoRAError(f"{name}: LoRA adapts linear layers, not {type(module).__name__}")
    if spec.r < 1 or spec.r > min(in_f, out_f):
        raise LoRAError(f"adapter.r = {spec.r} for {name} ({in_f} -> {out_f}): choose r from 1 "
                        f"to {min(in_f, out_f)}")
    if hasattr(module, "lora_A"):
        raise LoRAError(f"{name} already has LoRA factors")
    for p in module.parameters(recurse=False):
        p.requires_grad_(False)
    full_a, full_b = global_init(name, out_f, in_f, spec, seed)
    weight = module.weight
    full_a, full_b = full_a.to(weight.device), full_b.to(weight.device)
    if isinstance(module, Linear3D):
        grid = module.engine.comm.grid
        shape, coords = grid.shape, grid.shape.coords(grid.rank)
        a_layout = Layout(((), (module.in_axis,)))
        b_layout = Layout(((module.out_axis,),))
        a_local = a_layout.shard(full_a, shape, coords)
        b_local = b_layout.shard(full_b, shape, coords)
        hook = LoRAHook(spec, name, seed, counter, module.engine.comm, module.in_axis,
                        module.out_axis, whole_input_grad=module.own_fan_out,
                        mask_key=(coords[module.in_axis], *grid.batch_shard))
    else:
        a_layout = b_layout = Layout(())
        a_local, b_local = full_a, full_b
        hook = LoRAHook(spec, name, seed, counter)
    module.lora_A = LoRAFactor(a_local, a_layout)
    module.lora_B = LoRAFactor(b_local, b_layout)
    module.register_forward_hook(hook)
    return hook


def lora_layers(root: nn.Module) -> dict[str, nn.Module]:
    """The layers of `root` that carry LoRA factors, by qualified name."""
    return {n: m for n, m in root.named_modules() if isinstance(getattr(m, "lora_A", None),
                                                                 LoRAFactor)}
