"""Per-model engine state: the z all-gathers of weights (with one-ahead prefetch), the deferred
weight-gradient GEMMs and their z reduce-scatters, and the hand-off of final gradients to the
data-parallel bucketer. One Engine belongs to one parallelized model; nothing here is global.

The overlap schedule of one layer's backward (the layers are in linear.py):
  1. the layer's backward computes dI = dO W (partial over an axis) and defers dW = dO^T I;
  2. the fan-out op that produced the layer's input starts the dI all-reduce asynchronously,
     then runs the deferred dW GEMMs under it, and starts their z reduce-scatters;
  3. those reduce-scatters are waited for one fan-out later, under earlier layers' backward
     (after that fan-out's own dW GEMMs, so that the GEMMs run under its all-reduce); without
     a z axis there are none, and a dW GEMM's output is its weight's final gradient;
  4. a weight's gradient that is final goes to the data-parallel bucketer at once.

Weights are gathered in the compute dtype (the shard is cast first: the GEMM sees the same
values, the wire half the bytes under bfloat16). With activation checkpointing a module is
gathered in forward and again by the recompute, whose block the backward then uses (no third
gather); the recompute's gathers are prefetched, the first one from the backward of the module
before it. The last module of the forward (the output layer) keeps its gathered block for its
backward, which comes next, when the block is no larger than its output and the loss's float32
workspace (the memory model's `logits` term: the rule `keeps_output_block` states).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

import torch
from torch import nn

from fourfold.config import ParallelConfig
from fourfold.parallel.buffers import GradBufferPool
from fourfold.parallel.comm import Comm, Handle
from fourfold.parallel.data_parallel import GradBucketer
from fourfold.parallel.gemm import GemmTuner, default_cache_path, plain_matmul


@dataclass(frozen=True)
class OverlapOptions:
    input_grad: bool = True  # dI all-reduce under the dW GEMM
    weight_grad: bool = True  # dW reduce-scatter under earlier layers' backward
    prefetch: bool = True  # next layer's z all-gather one layer ahead
    data_grad: bool = True  # bucketed data all-reduce during backward
    bucket_bytes: int = ParallelConfig().bucket_bytes
    gemm_tuning: bool = False  # time the equivalent matmuls per shape, keep the fastest
    reduce_dtype: torch.dtype = torch.float32  # weight-gradient reduce-scatter, data all-reduce
    forward_split: bool = False  # each forward GEMM in two halves of the tokens: one half's
    # output all-reduce runs under the other half's GEMM (parallel.overlap_forward)


class ShardedModule(Protocol):
    """What the engine asks of a module whose weight is split over z (Linear3D, a group of
    FusedLinears, ParallelEmbedding): this rank's shard to all-gather, in the compute dtype;
    the gathered shards arranged as the module's full (x, y)-block; whether its backward needs
    the block again (an embedding's does not); the block's shape."""

    needs_backward_gather: bool
    block_shape: tuple[int, int]

    def gather_shard(self, compute_dtype: torch.dtype) -> torch.Tensor: ...

    def arrange(self, gathered: torch.Tensor) -> torch.Tensor: ...


def keeps_output_block(block_bytes: int, output_bytes: int, output_numel: int) -> bool:
    """The last module of the forward keeps its gathered block for its backward when the block
    is no larger than its output plus the loss's float32 workspace over that output."""
    return block_bytes <= output_bytes + 4 * output_numel


class Engine:
    def __init__(self, comm: Comm, options: OverlapOptions,
                 grad_buffers: GradBufferPool | None = None) -> None:
        self.comm = comm
        self.options = options
        # released gradients' buffers for the next weight gradient (parallel/buffers.py)
        self.grad_buffers = grad_buffers
        self.bucketer = GradBucketer(comm, options.bucket_bytes, options.data_grad,
                                     options.reduce_dtype)
        self.sharded: list[ShardedModule] = []  # z-sharded modules in forward order
        self._index: dict[int, int] = {}
        # per module in forward order: the repeated unit (block) it belongs to, None outside
        self._groups: list[Hashable | None] = []
        self._group_first: dict[Hashable, int] = {}
        self._recompute_expected = False
        self._recomputed: set[Hashable] = set()
        self._kept: dict[int, torch.Tensor] = {}  # recomputed blocks, used by the backward
        self._pass_hooks: list[Callable[[], None]] = []
        self._users: list[nn.Module] = []  # the z-sharded modules, as registered
        self._uses: dict[int, int] | None = None  # param id -> modules using it
        self._contributions: dict[int, int] = {}
        self._prefetched: dict[tuple[int, str], tuple[Handle, torch.dtype]] = {}
        self._done: dict[str, set[int]] = {"forward": set(), "recompute": set(),
                                           "backward": set()}
        self._deferred: list[Callable[[], None]] = []
        self._pending_rs: list[tuple[Handle, list[nn.Parameter]]] = []
        self.grad_sync = True
        self.prefetch_enabled = options.prefetch
        self.tuner = (GemmTuner(comm, default_cache_path(comm.grid.device))
                      if options.gemm_tuning else None)
        self._on_grad_ready: Callable[[nn.Parameter], None] | None = None
        self._ready: set[int] = set()

    def set_grad_ready_hook(self, hook: Callable[[nn.Parameter], None]) -> None:
        """Call `hook(param)` the moment param.grad is final (after its z reduce-scatter and data
        all-reduce), once per backward: fused-update methods (LOMO) update and free it there."""
        self._on_grad_ready = hook
        self.bucketer.on_ready = self._grad_ready

    def _grad_ready(self, param: nn.Parameter) -> None:
        if self._on_grad_ready is not None and id(param) not in self._ready:
            self._ready.add(id(param))
            self._on_grad_ready(param)

    def matmul(self, kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """A linear layer's GEMM (kind: forward, input_grad or weight_grad), tuned if enabled.
        Untuned, a weight gradient is written into a released gradient's buffer where the pool
        has one that fits (grad_buffer); tuned, such a buffer is dropped (its variants make
        their own)."""
        out = None
        if kind == "weight_grad":  # taken either way: the tuned variants make their own
            out = self._take_buffer((a.shape[-1], b.shape[-1]), a.dtype, a.device)
        if self.tuner is None:
            return plain_matmul(kind, a, b, out=out)
        return self.tuner.matmul(kind, a, b)

    # ---- gradient buffers -----------------------------------------------------------------

    def grad_buffer(self, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        """An uninitialised tensor for a weight's gradient (block): a released buffer where
        the pool holds one of its shape and dtype, else a new one."""
        kept = self._take_buffer(shape, dtype, device)
        return kept if kept is not None else torch.empty(shape, dtype=dtype, device=device)

    def release_grad(self, param: nn.Parameter) -> None:
        """param's gradient is used up (a fused update's hand-off): drop it, giving its buffer
        to the pool for a later gradient. The caller keeps no reference to it. Not with a z
        axis: there a gradient is a reduce-scatter's output, which would not take the buffer."""
        grad, param.grad = param.grad, None
        if grad is not None and self.grad_buffers is not None and self.comm.grid.size("z") == 1:
            self.grad_buffers.give(grad)

    def _take_buffer(self, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor | None:
        if self.grad_buffers is None:
            return None
        return self.grad_buffers.take(shape, dtype, device)

    # ---- registration -------------------------------------------------------------------

    def register(self, module: nn.Module) -> None:
        """Count a z-sharded module's use of its weight (a tied weight has two users)."""
        self._users.append(module)
        self._uses = None

    def _use_count(self, pid: int) -> int:
        # counted at the first backward: the weights a module holds then (a simulated rank's
        # materialisation gives the modules new parameter objects, parallel/shards.py)
        if self._uses is None:
            self._uses = {}
            for module in self._users:
                self._uses[id(module.weight)] = self._uses.get(id(module.weight), 0) + 1
        return self._uses[pid]

    def set_order(self, modules: list[ShardedModule],
                  groups: list[Hashable | None] | None = None) -> None:
        """The z-sharded modules in forward order, for prefetching one ahead (or behind), and
        the repeated unit each belongs to (what activation checkpointing recomputes whole)."""
        self.sharded = list(modules)
        self._index = {id(m): i for i, m in enumerate(self.sharded)}
        self._groups = list(groups) if groups is not None else [None] * len(self.sharded)
        self._group_first = {}
        for i, g in enumerate(self._groups):
            if g is not None:
                self._group_first.setdefault(g, i)

    def at_begin_forward(self, hook: Callable[[], None]) -> None:
        """Call `hook` (which drops a per-pass cache) whenever a forward pass starts."""
        self._pass_hooks.append(hook)

    def is_last(self, module: ShardedModule) -> bool:
        """Whether `module` is the last z-sharded module of the forward (its backward is first)."""
        return bool(self.sharded) and self.sharded[-1] is module

    # ---- passes -------------------------------------------------------------------------

    def begin_forward(self, recompute: bool = False) -> None:
        """A new forward pass (and so a new backward pass) starts; `recompute`: the blocks
        will be recomputed in backward (activation checkpointing), so prefetch for that."""
        for handle, _ in self._prefetched.values():
            handle.wait()  # never leave a collective in flight; its bytes are on the ledger
        self._prefetched.clear()
        for done in self._done.values():
            done.clear()
        self._kept.clear()
        self._recomputed.clear()
        self._recompute_expected = recompute
        for hook in self._pass_hooks:
            hook()

    # ---- z all-gather of weights ----------------------------------------------------------

    def _gather_async(self, module: ShardedModule, compute_dtype: torch.dtype) -> Handle:
        # cast first: the GEMM gets the same values, the wire carries the compute dtype
        return self.comm.all_gather(module.gather_shard(compute_dtype), "z", async_op=True)

    def gather_weight(self, module: ShardedModule, phase: str, dtype: torch.dtype,
                      kept: torch.Tensor | None = None) -> torch.Tensor:
        """The module's full (x, y)-block of weight, gathered over z in the dtype the module
        asks for under compute dtype `dtype` (phase: forward or backward; `kept`: a block the
        caller kept from forward). A forward gather of a module this forward already gathered
        is the recompute of a checkpointed block. Prefetches the next gather."""
        mid = id(module)
        z_split = self.comm.grid.size("z") > 1
        if phase == "forward" and mid in self._done["forward"]:
            phase = "recompute"
            group = self._groups[self._index[mid]]
            if group is not None:
                self._recomputed.add(group)
        if phase == "backward" and kept is None:
            kept = self._kept.pop(mid, None)
        if kept is not None:
            self._done[phase].add(mid)
            self._prefetch_next(module, phase, dtype)
            return kept
        entry = self._prefetched.pop((mid, phase), None)
        if entry is not None and entry[1] != dtype:  # the compute dtype changed: gather again
            entry[0].wait()
            entry = None
        handle = entry[0] if entry is not None else self._gather_async(module, dtype)
        self._done[phase].add(mid)
        self._prefetch_next(module, phase, dtype)
        w = module.arrange(handle.wait())
        if phase == "recompute" and z_split and module.needs_backward_gather:
            self._kept[mid] = w
        return w

    def _prefetch(self, module: ShardedModule, phase: str, dtype: torch.dtype) -> None:
        key = (id(module), phase)
        if key not in self._prefetched:
            self._prefetched[key] = (self._gather_async(module, dtype), dtype)

    def _prefetch_next(self, module: ShardedModule, phase: str, dtype: torch.dtype) -> None:
        if not self.prefetch_enabled or self.comm.grid.size("z") == 1:
            return
        i = self._index[id(module)]
        if phase == "forward":
            for nxt in self.sharded[i + 1:]:
                if id(nxt) not in self._done["forward"]:
                    self._prefetch(nxt, "forward", dtype)
                    return
            return
        if phase == "recompute":  # the rest of this block; the next one is already done
            j = i + 1
            if j < len(self.sharded) and self._groups[j] == self._groups[i] \
                    and id(self.sharded[j]) not in self._done["recompute"]:
                self._prefetch(self.sharded[j], "recompute", dtype)
            return
        for j in range(i - 1, -1, -1):
            nxt, group = self.sharded[j], self._groups[j]
            if self._recompute_expected and group is not None \
                    and group not in self._recomputed:
                # the backward of an earlier block starts with its recompute, in forward order
                self._prefetch(self.sharded[self._group_first[group]], "recompute", dtype)
                return
            if id(nxt) in self._done["backward"] or id(nxt) in self._kept \
                    or not nxt.needs_backward_gather:
                continue
            self._prefetch(nxt, "backward", dtype)
            return

    # ---- weight gradients -----------------------------------------------------------------

    def defer(self, work: Callable[[], None]) -> None:
        """Run `work` (a dW GEMM that starts its reduce-scatter) at the next flush."""
        self._deferred.append(work)

    def reduce_scatter_weight_grad(self, param: nn.Parameter, block_grad: torch.Tensor) -> None:
        """Sum a weight's block gradient over z into this rank's shard (asynchronously), in
        the reduce dtype on the wire."""
        self.reduce_scatter_weight_grads([param], [block_grad])

    def reduce_scatter_weight_grads(self, params: list[nn.Parameter],
                                    blocks: list[torch.Tensor]) -> None:
        """One reduce-scatter for the block gradients of weights that share their column
        split (a fused group): each rank's slices of all of them are laid out together.
        Without a z axis there is nothing to sum: each block is its weight's gradient, final
        now (were it held until a later flush, a memory-lean method's hand-off would wait
        beside the next layers' recomputed activations)."""
        z = self.comm.grid.size("z")
        if z == 1:
            for param, block in zip(params, blocks):
                self._add_grad(param, block.reshape(param.shape))
            return
        wire = self.options.reduce_dtype
        rest = params[0].shape[1:]
        if len(params) == 1:
            flat = blocks[0].to(wire).reshape(-1, *rest)
        else:  # (z, rows of each, ...) side by side, so that rank r's part is contiguous
            flat = torch.cat([b.to(wire).reshape(z, -1, *rest) for b in blocks], dim=1)
            flat = flat.reshape(-1, *rest)
        handle = self.comm.reduce_scatter(flat, "z", async_op=True)
        self._pending_rs.append((handle, params))
        if not self.options.weight_grad:
            self._complete_reduce_scatters()

    def flush(self) -> None:
        """Run the deferred dW GEMMs (under the caller's all-reduce, which is in flight), then
        finish the reduce-scatters that the previous flush started."""
        previous, self._pending_rs = self._pending_rs, []
        work, self._deferred = self._deferred, []
        for w in work:
            w()
        self._complete(previous)

    def _complete_reduce_scatters(self) -> None:
        pending, self._pending_rs = self._pending_rs, []
        self._complete(pending)

    def _complete(self, pending: list[tuple[Handle, list[nn.Parameter]]]) -> None:
        for handle, params in pending:
            shards = handle.wait()
            if len(params) == 1:
                self._add_grad(params[0], shards.view_as(params[0]))
                continue
            for param, grad in zip(params, shards.split([p.shape[0] for p in params])):
                self._add_grad(param, grad.view_as(param))

    def _add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if param.grad is None:
            # the slice is this pass's own tensor (a GEMM's output or a collective's buffer),
            # so it becomes the gradient without a copy (or in the parameter's dtype, cast
            # into a released gradient's buffer where one fits)
            param.grad = grad if grad.dtype == param.dtype else self.grad_buffer(
                tuple(grad.shape), param.dtype, grad.device).copy_(grad)
        else:
            param.grad.add_(grad)
        pid = id(param)
        self._contributions[pid] = self._contributions.get(pid, 0) + 1
        if self.grad_sync and self._contributions[pid] == self._use_count(pid):
            self.bucketer.add(param)
            if not self.bucketer.active:
                self._grad_ready(param)

    def finish_backward(self, z_replicated: list[nn.Parameter],
                        all_params: list[nn.Parameter]) -> None:
        self.flush()
        self._complete_reduce_scatters()
        for handle, _ in self._prefetched.values():
            handle.wait()
        self._prefetched.clear()
        self._kept.clear()
        if not self.grad_sync:
            self._contributions.clear()
            return
        # Parameters not split over z (norm weights, biases) got whole-batch-shard gradients
        # from autograd: sum them over z once per step, then over data with the rest.
        z_replicated = [p for p in z_replicated if p.requires_grad]  # frozen: no all-reduce
        if z_replicated and self.comm.grid.size("z") > 1:
            for p in z_replicated:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in z_replicated])  # type: ignore[union-attr]
            flat = self.comm.all_reduce(flat, "z", wire_dtype=self.options.reduce_dtype).wait()
            parts = flat.split([p.numel() for p in z_replicated])
            torch._foreach_copy_([p.grad for p in z_replicated],  # type: ignore[misc]
                                 [v.view_as(p) for v, p in zip(parts, z_replicated)])
        for p in all_params:
            self.bucketer.add(p)
        self.bucketer.finish()
        self.bucketer.start_step()
        self._contributions.clear()
        for p in all_params:  # the rest (norms, biases) are final now
            if p.grad is not None:
                self._grad_ready(p)
        self._ready.clear()
