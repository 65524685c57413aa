"""Per-model engine state: the z all-gathers of weights (with one-ahead prefetch), the deferred
weight-gradient GEMMs and their z reduce-scatters, and the hand-off of final gradients to the
data-parallel bucketer. One Engine belongs to one parallelized model; nothing here is global.

The overlap schedule of one layer's backward (see DESIGN.md):
  1. the layer's backward computes dI = dO W (partial over an axis) and defers dW = dO^T I;
  2. the fan-out op that produced the layer's input starts the dI all-reduce asynchronously,
     then runs the deferred dW GEMMs under it, and starts their z reduce-scatters;
  3. those reduce-scatters are waited for one fan-out later, under earlier layers' backward;
  4. a weight's gradient that is final goes to the data-parallel bucketer at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fourfold.parallel.comm import Comm, Handle
from fourfold.parallel.data_parallel import GradBucketer
from fourfold.parallel.gemm import GemmTuner, default_cache_path, plain_matmul


@dataclass(frozen=True)
class OverlapOptions:
    input_grad: bool = True  # dI all-reduce under the dW GEMM
    weight_grad: bool = True  # dW reduce-scatter under earlier layers' backward
    prefetch: bool = True  # next layer's z all-gather one layer ahead
    data_grad: bool = True  # bucketed data all-reduce during backward
    bucket_bytes: int = 25 * 2**20
    gemm_tuning: bool = False  # time the equivalent matmuls per shape, keep the fastest


class Engine:
    def __init__(self, comm: Comm, options: OverlapOptions) -> None:
        self.comm = comm
        self.options = options
        self.bucketer = GradBucketer(comm, options.bucket_bytes, options.data_grad)
        self.sharded: list[nn.Module] = []  # z-sharded modules in forward order
        self._index: dict[int, int] = {}
        self._uses: dict[int, int] = {}  # param id -> modules that use it (tied weights: 2)
        self._contributions: dict[int, int] = {}
        self._prefetched: dict[tuple[int, str], Handle] = {}
        self._done: dict[str, set[int]] = {"forward": set(), "backward": set()}
        self._deferred: list[Callable[[], None]] = []
        self._pending_rs: list[tuple[Handle, nn.Parameter]] = []
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
        """A linear layer's GEMM (kind: forward, input_grad or weight_grad), tuned if enabled."""
        if self.tuner is None:
            return plain_matmul(kind, a, b)
        return self.tuner.matmul(kind, a, b)

    # ---- registration -------------------------------------------------------------------

    def register(self, module: nn.Module) -> None:
        """Count a z-sharded module's use of its weight (a tied weight has two users)."""
        pid = id(module.weight)
        self._uses[pid] = self._uses.get(pid, 0) + 1

    def set_order(self, modules: list[nn.Module]) -> None:
        """The z-sharded modules in forward order, for prefetching one ahead (or behind)."""
        self.sharded = list(modules)
        self._index = {id(m): i for i, m in enumerate(self.sharded)}

    # ---- passes -------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A new forward pass (and so a new backward pass) starts."""
        for handle in self._prefetched.values():
            handle.wait()  # never leave a collective in flight; its bytes are on the ledger
        self._prefetched.clear()
        self._done["forward"].clear()
        self._done["backward"].clear()

    # ---- z all-gather of weights ----------------------------------------------------------

    def _gather_async(self, module: nn.Module) -> Handle:
        return self.comm.all_gather(module.weight.detach(), "z", async_op=True)

    def gather_weight(self, module: nn.Module, phase: str) -> torch.Tensor:
        """The module's full (x, y)-block of weight, gathered over z. Prefetches the next one."""
        key = (id(module), phase)
        handle = self._prefetched.pop(key, None)
        if handle is None:
            handle = self._gather_async(module)
        self._done[phase].add(id(module))
        self._prefetch_next(module, phase)
        return handle.wait().view(module.block_shape)

    def _prefetch_next(self, module: nn.Module, phase: str) -> None:
        if not self.prefetch_enabled or self.comm.grid.size("z") == 1:
            return
        i = self._index[id(module)]
        step = 1 if phase == "forward" else -1
        j = i + step
        while 0 <= j < len(self.sharded):
            nxt = self.sharded[j]
            if id(nxt) not in self._done[phase] and (phase == "forward"
                                                      or nxt.needs_backward_gather):
                key = (id(nxt), phase)
                if key not in self._prefetched:
                    self._prefetched[key] = self._gather_async(nxt)
                return
            j += step

    # ---- weight gradients -----------------------------------------------------------------

    def defer(self, work: Callable[[], None]) -> None:
        """Run `work` (a dW GEMM that starts its reduce-scatter) at the next flush."""
        self._deferred.append(work)

    def reduce_scatter_weight_grad(self, param: nn.Parameter, block_grad: torch.Tensor) -> None:
        """Sum a weight's block gradient over z into this rank's shard (asynchronously)."""
        handle = self.comm.reduce_scatter(block_grad.reshape(-1, *param.shape[1:]), "z",
                                          async_op=True)
        self._pending_rs.append((handle, param))
        if not self.options.weight_grad:
            self._complete_reduce_scatters()

    def flush(self) -> None:
        """Finish the reduce-scatters of the previous flush, then run deferred dW work."""
        self._complete_reduce_scatters()
        work, self._deferred = self._deferred, []
        for w in work:
            w()

    def _complete_reduce_scatters(self) -> None:
        pending, self._pending_rs = self._pending_rs, []
        for handle, param in pending:
            grad = handle.wait().view_as(param)
            if param.grad is None:
                # the block is this pass's own tensor (a GEMM's output or a collective's
                # buffer), so it becomes the gradient without a copy
                param.grad = grad.to(param.dtype)
            else:
                param.grad.add_(grad)
            pid = id(param)
            self._contributions[pid] = self._contributions.get(pid, 0) + 1
            if self.grad_sync and self._contributions[pid] == self._uses[pid]:
                self.bucketer.add(param)
                if not self.bucketer.active:
                    self._grad_ready(param)

    def finish_backward(self, z_replicated: list[nn.Parameter],
                        all_params: list[nn.Parameter]) -> None:
        self.flush()
        self._complete_reduce_scatters()
        for handle in self._prefetched.values():
            handle.wait()
        self._prefetched.clear()
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
            flat = self.comm.all_reduce(flat, "z").wait()
            offset = 0
            for p in z_replicated:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        for p in all_params:
            self.bucketer.add(p)
        self.bucketer.finish()
        self.bucketer.start_step()
        self._contributions.clear()
        for p in all_params:  # the rest (norms, biases) are final now
            if p.grad is not None:
                self._grad_ready(p)
        self._ready.clear()
