"""The data-parallel bucketer on one process, its all-reduce stood in for by a recording one:
gradients become views of their bucket's buffer (no copy made to send a bucket, none copied
back), no bucket buffer outlives the step in the bucketer, at most two buckets are in flight
where the wire holds casts, and the buckets follow the order gradients arrive in. Exactness
against one process on real data grids: tests/test_parallel.py."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch
from torch import nn

from fourfold.parallel.data_parallel import GradBucketer, in_flight_wire_bytes

REPLICAS = 3  # the data ranks the recording all-reduce sums over (all hold the same gradients)


class _Handle:
    def __init__(self, comm: "RecordingComm", target: torch.Tensor, wire: torch.Tensor) -> None:
        self.comm, self.target, self.wire, self.done = comm, target, wire, False

    def wait(self) -> torch.Tensor:
        if not self.done:
            self.target.copy_(self.wire * REPLICAS)  # the sum over identical replicas, in place
            self.done = True
            self.comm.in_flight.remove(self)
        return self.target


class RecordingComm:
    """Comm's all-reduce over a data axis whose replicas hold the same values: records every
    buffer handed to it and how many are in flight."""

    def __init__(self) -> None:
        self.grid = SimpleNamespace(group=lambda axis: "data-group" if axis == "data" else None)
        self.handed: list[torch.Tensor] = []
        self.in_flight: list[_Handle] = []
        self.most_in_flight = 0

    def all_reduce(self, t: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False,
                   wire_dtype: torch.dtype | None = None) -> _Handle:
        assert axis == "data" and async_op and t.is_contiguous()
        self.handed.append(t)
        handle = _Handle(self, t, t.to(wire_dtype) if wire_dtype is not None else t)
        self.in_flight.append(handle)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return handle


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(shape)) for shape in [(8, 4), (16,), (4, 4), (32,), (2, 3)]]


def _step(bucketer: GradBucketer, params: list[nn.Parameter], order: list[int],
          seed: int) -> dict[int, torch.Tensor]:
    """One backward's hand-offs in `order`; returns the gradients each parameter came with."""
    g = torch.Generator().manual_seed(seed)
    given = {}
    bucketer.start_step()
    for i in order:
        params[i].grad = torch.randn(params[i].shape, generator=g)
        given[i] = params[i].grad.clone()
        bucketer.add(params[i])
    bucketer.finish()
    return given


def test_gradients_are_views_of_their_buckets_and_nothing_else_outlives_the_step() -> None:
    comm = RecordingComm()
    params = _params()
    # 96 bytes a bucket: (8, 4) alone (128 B), then (16,) + (4, 4) (128 B), (32,), (2, 3)
    bucketer = GradBucketer(comm, bucket_bytes=96, overlap=True)
    order = [0, 1, 2, 3, 4]
    given = _step(bucketer, params, order, seed=0)
    # the first step has no buckets: each gradient is reduced in place on its own
    assert [t.data_ptr() for t in comm.handed] == [p.grad.data_ptr() for p in params]
    for i, p in enumerate(params):
        assert torch.equal(p.grad, given[i] * REPLICAS)

    comm.handed.clear()
    given = _step(bucketer, params, order, seed=1)
    assert len(comm.handed) == 4  # the buckets cut from the first step's order
    storages = {t.untyped_storage().data_ptr(): t for t in comm.handed}
    for i, p in enumerate(params):
        assert torch.equal(p.grad, given[i] * REPLICAS)
        assert p.grad.untyped_storage().data_ptr() in storages  # a view: no copy made or kept
    # at the end of backward the buckets' buffers are the gradients, with no copy beside them
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
    assert sum(t.untyped_storage().nbytes() for t in storages.values()) == grad_bytes
    held = [weakref.ref(t.untyped_storage()) for t in comm.handed]
    comm.handed.clear()
    del storages
    for p in params:
        p.grad = None  # what the optimizer's zero_grad does: no buffer survives it
    assert all(ref() is None for ref in held)
    assert comm.in_flight == []


def test_a_lower_wire_dtype_keeps_at_most_two_buckets_in_flight() -> None:
    comm = RecordingComm()
    params = _params()
    bucketer = GradBucketer(comm, bucket_bytes=64, overlap=True, reduce_dtype=torch.bfloat16)
    for seed in range(3):
        given = _step(bucketer, params, [0, 1, 2, 3, 4], seed)
        for i, p in enumerate(params):
            torch.testing.assert_close(p.grad, (given[i].bfloat16() * REPLICAS).float())
    assert comm.most_in_flight == 2
    # in the gradients' own dtype nothing is held beyond them: waited for at the end
    assert in_flight_wire_bytes(64, 4, 4) == 0 and in_flight_wire_bytes(64, 4, 2) == 64


def test_fused_updates_get_each_gradient_once_summed() -> None:
    comm = RecordingComm()
    params = _params()
    bucketer = GradBucketer(comm, bucket_bytes=96, overlap=True)
    handed: list[tuple[int, torch.Tensor]] = []

    def take(p: nn.Parameter) -> None:  # a fused update: uses the gradient, then lets it go
        handed.append((next(i for i, q in enumerate(params) if q is p), p.grad.clone()))
        p.grad = None

    bucketer.on_ready = take
    for seed in range(3):
        handed.clear()
        given = _step(bucketer, params, [0, 1, 2, 3, 4], seed)
        assert sorted(i for i, _ in handed) == [0, 1, 2, 3, 4]
        for i, grad in handed:
            assert torch.equal(grad, given[i] * REPLICAS)
    assert comm.most_in_flight <= 2


def test_a_new_order_is_reduced_right_and_cuts_the_buckets_again() -> None:
    comm = RecordingComm()
    params = _params()
    bucketer = GradBucketer(comm, bucket_bytes=96, overlap=True)
    _step(bucketer, params, [0, 1, 2, 3, 4], seed=0)
    for order in ([4, 3, 2, 1, 0], [4, 3, 2, 1, 0], [1, 0, 3]):
        comm.handed.clear()
        given = _step(bucketer, params, order, seed=5)
        for i in order:
            assert torch.equal(params[i].grad, given[i] * REPLICAS)
    # each new order was summed right, and the buckets now follow the last one: (16,) 64 B +
    # (8, 4) 128 B, then (32,)
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b.params] for b in bucketer._buckets] == [[1, 0], [3]]


def test_without_overlap_nothing_starts_before_the_end_of_backward() -> None:
    comm = RecordingComm()
    params = _params()
    bucketer = GradBucketer(comm, bucket_bytes=96, overlap=False)
    for seed in range(2):  # the first step (no buckets yet) and one with buckets
        bucketer.start_step()
        given = {}
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + i))
            given[i] = p.grad.clone()
            bucketer.add(p)
        assert comm.in_flight == [] and comm.handed == []
        bucketer.finish()
        comm.handed.clear()
        for i, p in enumerate(params):
            assert torch.equal(p.grad, given[i] * REPLICAS)
