"""Bucketed gradient all-reduce over the data axis.

Gradients become final (every z reduce-scatter of the step done) at different moments of
backward. Each one is written into its bucket's flat buffer as it becomes final and the
parameter's gradient becomes a view of that buffer, as in DDP's and Megatron's gradient
buffers: the all-reduce runs in place on the buffer, with no copy of the bucket made to send it
and none copied back. A bucket whose gradients are all in starts its all-reduce at once, so the
data-parallel traffic runs while backward is still computing; buckets start in order (all of
them at the end of backward where parallel.overlap_data_grad is off).

The buckets are cut from the order in which the gradients arrived in the step before (a step
whose order differs cuts them again), so a bucket's buffer is made at its first gradient,
sized for all of them. The bucketer lets go of a buffer once its all-reduce has started: the
gradients (views) hold it, until the optimizer or a fused update drops them, so no gradient is
alive at the next forward. A gradient that has no place in the buckets (the first step, a
parameter new to the step) is all-reduced in place on its own.

What the all-reduce holds beyond the gradients (`in_flight_wire_bytes`): nothing where the wire
carries the gradients' own dtype; with parallel.reduce_dtype below it, each bucket's cast to the
wire dtype until it is waited for. Then, and where a fused update wants each gradient as soon
as it is summed (`on_ready`), every start waits for the buckets before the one still in flight,
so at most two are in flight. Otherwise they are waited for at the end of backward: waiting
sooner saves nothing, and on a GPU it would hold the backward's stream behind the collective.

All data ranks run the same graph, so gradients arrive in the same order everywhere, every rank
cuts the same buckets, and the collectives match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from fourfold.parallel.comm import Comm, Handle


def in_flight_wire_bytes(bucket_bytes: int, grad_bytes: int, reduce_bytes: int) -> int:
    """Bytes the data all-reduce holds beyond the gradients (the memory model's comm_buffers):
    none where the gradients travel in their own dtype; else the wire-dtype casts of the two
    buckets that may be in flight."""
    if reduce_bytes == grad_bytes:
        return 0
    return 2 * (bucket_bytes // grad_bytes) * reduce_bytes


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]  # in arrival order
    offsets: list[int]  # element offset of each in `flat`
    numel: int
    dtype: torch.dtype
    device: torch.device
    flat: torch.Tensor | None = None  # this step's buffer, from its first gradient to its start
    ready: list[nn.Parameter] = field(default_factory=list)  # arrived this step

    def holds(self, index: int, grad: torch.Tensor | None, param: nn.Parameter) -> bool:
        """Whether the slot `index` fits this step's gradient of `param`."""
        dtype = grad.dtype if grad is not None else param.dtype
        return (self.params[index] is param and dtype == self.dtype
                and param.device == self.device)


class GradBucketer:
    def __init__(self, comm: Comm, bucket_bytes: int, overlap: bool,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.comm = comm
        self.reduce_dtype = reduce_dtype  # on the wire; gradients stay in their own dtype
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self._buckets: list[_Bucket] = []
        self._slot: dict[int, tuple[_Bucket, int]] = {}  # id(param) -> its bucket and index
        # this step's gradients in order of arrival, with the dtype and device each came in
        self._arrived: list[tuple[nn.Parameter, torch.dtype, torch.device]] = []
        self._next = 0  # the first bucket not started this step
        self._in_flight: list[tuple[Handle, list[nn.Parameter]]] = []
        self._loose: list[nn.Parameter] = []  # no bucket, not started yet (overlap off)
        self._seen: set[int] = set()
        # set by Engine.set_grad_ready_hook: each bucket's gradients are handed on as soon as
        # its all-reduce is done, and at most two buckets are in flight
        self.on_ready: Callable[[nn.Parameter], None] | None = None

    @property
    def active(self) -> bool:
        """Whether gradients are summed over data: the grid has a data-axis group (data > 1,
        or a one-rank grid that forces the engine's collectives)."""
        return self.comm.grid.group("data") is not None

    def start_step(self) -> None:
        self._seen.clear()
        self._arrived = []
        self._next = 0
        for bucket in self._buckets:
            bucket.ready = []

    def add(self, param: nn.Parameter) -> None:
        """`param.grad` is final for this step: write it into its bucket (param.grad becomes a
        view of the bucket's buffer) and start the buckets that are complete."""
        if not self.active or id(param) in self._seen or not param.requires_grad:
            return
        self._seen.add(id(param))
        grad = param.grad
        self._arrived.append((param, param.dtype if grad is None else grad.dtype, param.device))
        bucket, index = self._slot.get(id(param), (None, 0))
        if bucket is None or not bucket.holds(index, grad, param):
            # no place for it: reduced in place on its own (the first step cuts no buckets)
            if grad is None or not grad.is_contiguous():
                param.grad = (torch.zeros_like(param) if grad is None else grad.contiguous())
            self._loose.append(param)
            if self.overlap:
                self._start_loose()
            return
        if bucket.flat is None:
            bucket.flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        offset = bucket.offsets[index]
        view = bucket.flat[offset:offset + param.numel()].view_as(param)
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        param.grad = view  # the gradient's own tensor goes
        bucket.ready.append(param)
        if self.overlap:
            self._start_complete()

    def _start_loose(self) -> None:
        for param in self._loose:
            self._start(param.grad, [param])  # type: ignore[arg-type]
        self._loose = []

    def _start_complete(self) -> None:
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._start_bucket(bucket)

    def _start_bucket(self, bucket: _Bucket) -> None:
        self._next += 1
        if bucket.flat is None:  # none of its parameters had a gradient this step (every rank)
            return
        # a slot whose parameter did not come this step holds garbage; no gradient reads it
        flat, bucket.flat = bucket.flat, None  # the gradients (its views) hold it from here
        self._start(flat, bucket.ready)

    def _start(self, flat: torch.Tensor, params: list[nn.Parameter]) -> None:
        handle = self.comm.all_reduce(flat, "data", async_op=True, wire_dtype=self.reduce_dtype)
        self._in_flight.append((handle, params))
        if self.on_ready is not None or flat.dtype != self.reduce_dtype:
            self._complete(self._in_flight[:-1])
            self._in_flight = self._in_flight[-1:]

    def finish(self) -> None:
        """Start what is left, in order, wait for every all-reduce (the summed gradients are in
        place), and cut the buckets anew where this step's gradients came in another order."""
        while self._next < len(self._buckets):
            self._start_bucket(self._buckets[self._next])
        self._start_loose()
        self._complete(self._in_flight)
        self._in_flight = []
        planned = [(p, b.dtype, b.device) for b in self._buckets for p in b.params]
        if len(planned) != len(self._arrived) or any(
                a[0] is not b[0] or a[1:] != b[1:] for a, b in zip(planned, self._arrived)):
            self._cut(self._arrived)

    def _complete(self, in_flight: list[tuple[Handle, list[nn.Parameter]]]) -> None:
        for handle, params in in_flight:
            handle.wait()  # the all-reduce wrote the sum into the gradients' buffer
            if self.on_ready is not None:
                for p in params:
                    self.on_ready(p)

    def _cut(self, arrived: list[tuple[nn.Parameter, torch.dtype, torch.device]]) -> None:
        """Buckets of consecutive gradients of one dtype and device, each closed once it holds
        bucket_bytes."""
        self._buckets, self._slot = [], {}
        members: list[nn.Parameter] = []
        size = 0
        kind: tuple[torch.dtype, torch.device] | None = None

        def close() -> None:
            nonlocal members, size
            if not members or kind is None:
                return
            offsets = [0]
            for p in members[:-1]:
                offsets.append(offsets[-1] + p.numel())
            bucket = _Bucket(members, offsets, offsets[-1] + members[-1].numel(), *kind)
            for i, p in enumerate(members):
                self._slot[id(p)] = (bucket, i)
            self._buckets.append(bucket)
            members, size = [], 0

        for param, dtype, device in arrived:
            if members and (dtype, device) != kind:
                close()
            kind = (dtype, device)
            members.append(param)
            size += param.numel() * dtype.itemsize
            if size >= self.bucket_bytes:
                close()
        close()
