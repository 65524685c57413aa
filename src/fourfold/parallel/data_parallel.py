"""Bucketed gradient all-reduce over the data axis.

Gradients are final (every z reduce-scatter of the step done) at different moments of backward;
each one is added to a bucket as it becomes final, and a full bucket starts its all-reduce at
once, so the data-parallel traffic runs while backward is still computing. All data ranks run the
same graph, so buckets fill in the same order everywhere and the collectives match.
"""

from __future__ import annotations

from typing import Callable

import torch

from fourfold.parallel.comm import Comm, Handle


class GradBucketer:
    def __init__(self, comm: Comm, bucket_bytes: int, overlap: bool,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.comm = comm
        self.reduce_dtype = reduce_dtype  # on the wire; gradients stay in their own dtype
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self._bucket: list[torch.nn.Parameter] = []
        self._bucket_size = 0
        self._in_flight: list[tuple[Handle, list[torch.nn.Parameter]]] = []
        self._seen: set[int] = set()
        # set by Engine.set_grad_ready_hook: each bucket's gradients are handed on as soon as
        # its all-reduce is done, and at most two buckets are in flight
        self.on_ready: Callable[[torch.nn.Parameter], None] | None = None

    @property
    def active(self) -> bool:
        return self.comm.grid.size("data") > 1

    def start_step(self) -> None:
        self._seen.clear()

    def add(self, param: torch.nn.Parameter) -> None:
        """`param.grad` is final for this step: queue it for the data all-reduce."""
        if not self.active or id(param) in self._seen or not param.requires_grad:
            return
        self._seen.add(id(param))
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        self._bucket.append(param)
        self._bucket_size += param.grad.numel() * param.grad.element_size()
        if self.overlap and self._bucket_size >= self.bucket_bytes:
            self._launch()

    def _launch(self) -> None:
        if not self._bucket:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self._bucket])  # type: ignore[union-attr]
        handle = self.comm.all_reduce(flat, "data", async_op=True, wire_dtype=self.reduce_dtype)
        self._in_flight.append((handle, self._bucket))
        self._bucket, self._bucket_size = [], 0
        if self.on_ready is not None:
            self._complete(self._in_flight[:-1])
            self._in_flight = self._in_flight[-1:]

    def finish(self) -> None:
        """Launch what is left and write the summed gradients back."""
        self._launch()
        self._complete(self._in_flight)
        self._in_flight.clear()

    def _complete(self, in_flight: list[tuple[Handle, list[torch.nn.Parameter]]]) -> None:
        for handle, params in in_flight:
            flat = handle.wait()
            grads = [p.grad for p in params]
            parts = flat.split([g.numel() for g in grads])  # type: ignore[union-attr]
            # one multi-tensor copy, not one small kernel per parameter
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(parts, grads)])
            if self.on_ready is not None:
                for p in params:
                    self.on_ready(p)
