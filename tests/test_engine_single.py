"""Engine pieces that need no second process: layouts, grid arithmetic, GEMM tuning."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from fourfold.config import ParallelConfig, model_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridError, GridShape, Layout, parallelize
from fourfold.parallel import gemm
from fourfold.parallel.gemm import VARIANTS, GemmTuner


def test_grid_rank_order_x_innermost() -> None:
    shape = GridShape(data=2, z=2, y=2, x=2)
    assert shape.coords(1) == {"x": 1, "y": 0, "z": 0, "data": 0}
    assert shape.coords(2) == {"x": 0, "y": 1, "z": 0, "data": 0}
    assert shape.coords(4)["z"] == 1 and shape.coords(8)["data"] == 1
    for rank in range(shape.size):
        assert shape.rank_of(shape.coords(rank)) == rank
    assert shape.axis_groups("x")[0] == [0, 1]
    assert shape.axis_groups("y")[0] == [0, 2]
    assert shape.axis_groups("data")[0] == [0, 8]


def test_stride_and_rank_grid_follow_the_one_rank_order() -> None:
    from fourfold.train.checkpoint import MESH_AXES, mesh_tensor

    shape = GridShape(data=2, z=3, y=2, x=4)  # unequal sizes: a swapped axis shows
    assert [shape.stride(a) for a in ("x", "y", "z", "data")] == [1, 4, 8, 24]
    for axis in ("x", "y", "z", "data"):  # neighbours in a group are `stride` ranks apart
        group = shape.axis_groups(axis)[0]
        assert all(b - a == shape.stride(axis) for a, b in zip(group, group[1:]))
    mesh = mesh_tensor(Grid(shape=shape))
    assert list(mesh.shape) == [getattr(shape, a) for a in MESH_AXES]
    for rank in range(shape.size):
        c = shape.coords(rank)
        assert mesh[tuple(c[a] for a in MESH_AXES)].item() == rank
    assert shape.rank_grid().flatten().tolist() == list(range(shape.size))


def test_grid_resolve_errors_name_the_numbers() -> None:
    assert GridShape.resolve(2, 2, 1, "auto", 8).data == 2
    with pytest.raises(GridError, match="does not divide the world size 6"):
        GridShape.resolve(4, 1, 1, "auto", 6)
    with pytest.raises(GridError, match="= 4 but the job has 8 ranks"):
        GridShape.resolve(2, 2, 1, 1, 8)
    with pytest.raises(GridError, match="parallel.y = 0: must be at least 1"):
        GridShape.resolve(2, 0, 1, "auto", 8)  # named, not a division by zero


def test_layout_shards_tile_the_full_tensor() -> None:
    shape = GridShape(data=1, z=2, y=2, x=2)
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    layout = Layout((("y", "z"), ("x",)))
    seen = torch.zeros_like(full)
    for rank in range(shape.size):
        coords = shape.coords(rank)
        block = layout.shard(full, shape, coords)
        assert block.shape == (2, 3)
        r0, c0 = layout.offsets((8, 6), shape, coords)
        seen[r0:r0 + 2, c0:c0 + 3] += 1
        # y is the outer split of rows, z the inner one
        assert r0 == (coords["y"] * 2 + coords["z"]) * 2
    assert torch.all(seen == 1)
    assert layout.replicas(shape) == 1
    assert Layout((("x",),)).replicas(shape) == 4  # replicated over y and z


def test_layout_rejects_indivisible_dims() -> None:
    with pytest.raises(GridError, match="not divisible"):
        Layout((("x",),)).local_shape((5,), GridShape(x=2), "norm")


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_gemm_variants_agree(kind: str) -> None:
    torch.manual_seed(0)
    a = torch.randn(24, 16)
    b = torch.randn(12, 16) if kind == "forward" else (
        torch.randn(16, 12) if kind == "input_grad" else torch.randn(24, 12))
    outs = [fn(a, b) for _, fn in VARIANTS[kind]]
    assert any(name.startswith("onednn:") for name, _ in VARIANTS[kind])
    for out in outs:
        assert out.is_contiguous()
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)


def test_gemm_tuner_caches_its_choice(tmp_path) -> None:
    tuner = GemmTuner(None, tmp_path / "gemm.json", repeats=1)
    a, b = torch.randn(32, 16), torch.randn(8, 16)
    out = tuner.matmul("forward", a, b)
    torch.testing.assert_close(out, a @ b.t(), rtol=1e-5, atol=1e-5)
    assert len(tuner.choices) == 1
    again = GemmTuner(None, tmp_path / "gemm.json")
    assert again.choices == tuner.choices


def test_gemm_tuner_keys_token_counts_by_power_of_two(tmp_path) -> None:
    tuner = GemmTuner(None, tmp_path / "gemm.json", repeats=1)
    b = torch.randn(8, 16)
    for n in (5, 7, 8, 9):  # 5..8 share a bucket; 9 opens the next
        a = torch.randn(n, 16)
        torch.testing.assert_close(tuner.matmul("forward", a, b), a @ b.t(), rtol=1e-5,
                                   atol=1e-5)
    assert sorted(tuner.choices) == ["forward:(16, 16)x(8, 16):torch.float32",
                                     "forward:(8, 16)x(8, 16):torch.float32"]
    assert set(tuner.choices.values()) <= {name for name, _ in VARIANTS["forward"]}


def test_gemm_tuner_skips_a_variant_that_cannot_run(tmp_path, monkeypatch) -> None:
    def no_onednn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this build has no oneDNN")

    monkeypatch.setattr(gemm, "_onednn_linear", no_onednn)
    tuner = GemmTuner(None, None, repeats=1)
    a, b, x = torch.randn(32, 8), torch.randn(8, 16), torch.randn(32, 16)
    for kind, bb, want in (("forward", b.t().contiguous(), a @ b), ("input_grad", b, a @ b),
                           ("weight_grad", x, a.t() @ x)):
        torch.testing.assert_close(tuner.matmul(kind, a, bb), want, rtol=1e-5, atol=1e-5)
    assert not any(v.startswith("onednn:") for v in tuner.choices.values())


def test_gemm_tuner_ignores_a_stale_cache(tmp_path) -> None:
    path = tmp_path / "gemm.json"
    # an older cache stored variant indices, not names: unknown choices are tuned again
    path.write_text('{"forward:(32, 16)x(8, 16):torch.float32": 2, "nonsense": "a@bT"}')
    tuner = GemmTuner(None, path, repeats=1)
    assert tuner.choices == {}
    tuner.matmul("forward", torch.randn(32, 16), torch.randn(8, 16))
    assert list(tuner.choices) == ["forward:(32, 16)x(8, 16):torch.float32"]


@pytest.mark.slow
def test_tuned_single_process_model_trains_like_the_plain_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FOURFOLD_CACHE", str(tmp_path))
    cfg = model_config("debug")
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = {}
    for tuning in (False, True):
        model = build_model(cfg, seed=3)
        pm = parallelize(model, Grid.single(), ParallelConfig(gemm_tuning=tuning))
        opt = torch.optim.SGD(list(pm.parameters()), lr=0.5)
        run = []
        for _ in range(3):
            loss = pm(tokens[:, :-1], tokens[:, 1:]).mean()
            loss.backward()
            pm.finish_backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[tuning] = run
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_without_a_z_axis_a_weight_gradient_is_final_at_its_gemm() -> None:
    """With z = 1 there is nothing to reduce-scatter: a dW GEMM's block is its weight's final
    gradient at once (no copy for a fused group, no wait for a later flush, when a memory-lean
    method would still hold it beside the next layers' recomputed activations)."""
    from fourfold.parallel.comm import Comm
    from fourfold.parallel.engine import Engine, OverlapOptions

    engine = Engine(Comm(Grid.single()), OverlapOptions())
    ready: list[torch.nn.Parameter] = []
    engine.set_grad_ready_hook(ready.append)
    q, k = (torch.nn.Parameter(torch.zeros(4, 3)) for _ in range(2))
    for p in (q, k):
        engine.register(SimpleNamespace(weight=p))  # one use each (a module and its weight)
    blocks = [torch.randn(4, 3), torch.randn(4, 3)]
    engine.reduce_scatter_weight_grads([q, k], blocks)
    assert ready == [q, k] and not engine._pending_rs
    assert q.grad is not None and k.grad is not None
    assert q.grad.data_ptr() == blocks[0].data_ptr() and torch.equal(k.grad, blocks[1])


def test_a_released_gradient_is_the_buffer_of_the_next_one_of_its_shape() -> None:
    """A fused update's hand-off lets go of a host gradient (release_grad): with a buffer
    pool (what a host run gives its engine) the engine keeps the largest such buffer and the
    next weight gradient of that shape is written into it (a dW GEMM, the embedding's block, a
    cast from bfloat16), so the two largest gradients of a step stop landing on top of the
    heap. A view, a smaller gradient and a buffer of the wrong dtype (found at a request, or
    asked for so before) are not kept; without a pool nothing is."""
    from fourfold.parallel.buffers import GradBufferPool
    from fourfold.parallel.comm import Comm
    from fourfold.parallel.engine import Engine, OverlapOptions

    plain = Engine(Comm(Grid.single()), OverlapOptions())
    w = torch.nn.Parameter(torch.zeros(6, 5))
    w.grad = torch.randn(6, 5)
    released = weakref.ref(w.grad)
    plain.release_grad(w)
    assert w.grad is None and released() is None  # nothing holds it: freed at once
    engine = Engine(Comm(Grid.single()), OverlapOptions(), GradBufferPool())
    big, small = torch.nn.Parameter(torch.zeros(6, 5)), torch.nn.Parameter(torch.zeros(2, 5))
    for p in (big, small):
        engine.register(SimpleNamespace(weight=p))
    big.grad = torch.randn(6, 5)
    kept = big.grad.data_ptr()
    engine.release_grad(big)
    assert big.grad is None
    small.grad = torch.randn(2, 5)
    engine.release_grad(small)  # smaller than the one kept: dropped
    dy, x = torch.randn(7, 6), torch.randn(7, 5)
    dw = engine.matmul("weight_grad", dy, x)
    assert dw.data_ptr() == kept and torch.allclose(dw, dy.t() @ x)
    assert engine.matmul("weight_grad", dy, x).data_ptr() != kept  # taken once

    cpu = torch.device("cpu")
    base = torch.randn(12, 5)
    big.grad = base[::2]  # a view: not a buffer of its own
    engine.release_grad(big)
    assert engine.grad_buffer((6, 5), torch.float32, cpu).data_ptr() != base.data_ptr()
    # a bfloat16 block becomes a float32 gradient in the kept buffer
    big.grad = torch.randn(6, 5)
    kept = big.grad.data_ptr()
    engine.release_grad(big)
    block = torch.randn(6, 5).bfloat16()
    engine.reduce_scatter_weight_grad(big, block)
    assert big.grad.dtype == torch.float32 and big.grad.data_ptr() == kept
    assert torch.equal(big.grad, block.float())
    # a request of the kept shape in another dtype drops it (it would only sit beside), and
    # that shape is not kept again: a smaller gradient's buffer is. (The test holds the
    # buffer, so that a new tensor cannot be malloc'd at its freed address.)
    held = big.grad
    assert held.data_ptr() == kept
    engine.release_grad(big)
    assert engine.grad_buffer((6, 5), torch.bfloat16, cpu).dtype == torch.bfloat16
    assert engine.grad_buffer((6, 5), torch.float32, cpu).data_ptr() != kept
    big.grad = torch.randn(6, 5)
    engine.release_grad(big)
    small.grad = torch.randn(2, 5)
    kept = small.grad.data_ptr()
    engine.release_grad(small)
    assert engine.grad_buffer((2, 5), torch.float32, cpu).data_ptr() == kept
    # a shape first asked for in another dtype is not kept from its first release on (the
    # blocked loss's bfloat16 dW on a grid: kept, the buffer sat through the next forward)
    fresh = Engine(Comm(Grid.single()), OverlapOptions(), GradBufferPool())
    assert fresh.grad_buffer((2, 5), torch.bfloat16, cpu).dtype == torch.bfloat16
    small.grad = held = torch.randn(2, 5)
    fresh.release_grad(small)
    assert small.grad is None
    assert fresh.grad_buffer((2, 5), torch.float32, cpu).data_ptr() != held.data_ptr()


def test_tensor_axis_groups_get_high_priority_streams_on_nccl(monkeypatch) -> None:
    """The options Grid.build makes each process group with, as it hands them to
    torch.distributed (stood in for here: a CPU build of torch has no NCCL): on NCCL the tensor
    axes' groups (x, y, z, the tensor group, z's gather group) get high-priority streams, the
    data axis's does not; on gloo none gets options. Both ways of making groups (split_group
    where the default group is bound to a device, new_group otherwise) pass them."""
    import datetime

    import torch.distributed as dist

    from fourfold.parallel import grid as grid_module

    class Options:  # ProcessGroupNCCL.Options
        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream

    made: list[tuple[str, object]] = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=Options),
                        raising=False)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "new_group", lambda ranks, pg_options=None, group_desc="", **k:
                        made.append((group_desc, pg_options)) or group_desc)
    monkeypatch.setattr(dist, "split_group", lambda pg_options=None, group_desc="", **k:
                        made.append((group_desc, pg_options)) or group_desc)
    shape = GridShape(data=2, z=2, y=2, x=2)
    wanted = [(a, shape.axis_groups(a)) for a in ("x", "y", "z", "data")]
    wanted += [("tensor", [list(range(8)), list(range(8, 16))]),
               ("z-gather", shape.axis_groups("z"))]
    high = {"fourfold_x", "fourfold_y", "fourfold_z", "fourfold_tensor", "fourfold_z-gather"}
    for bound in (None, torch.device("cuda", 0)):  # new_group, then split_group
        for backend in ("nccl", "gloo"):
            made.clear()
            monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
            monkeypatch.setattr(dist.distributed_c10d, "_get_default_group",
                                lambda: SimpleNamespace(bound_device_id=bound))
            grid_module._make_groups(wanted, 0, datetime.timedelta(seconds=1))
            assert [name for name, _ in made] == [f"fourfold_{n}" for n, _ in wanted]
            for name, options in made:
                if backend == "nccl" and name in high:
                    assert options.is_high_priority_stream, name
                else:
                    assert options is None, (backend, name)
    assert grid_module.group_options("data", "nccl") == {}
    assert grid_module.group_options("x", "gloo") == {}


def test_an_nccl_rank_sets_cuda_device_max_connections_before_cuda(monkeypatch) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS = 1 where the user has not set it, on an NCCL rank only,
    set before the rank's CUDA context is made (torch.cuda.set_device makes it); a value the
    user set stays."""
    import os

    import torch.distributed as dist

    from fourfold.parallel import grid as grid_module
    from fourfold.parallel.grid import init_distributed, nccl_environment

    assert nccl_environment({}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert nccl_environment({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == {}
    seen: list[str | None] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen.append(
        os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # a gloo rank's threads
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    for user_value in (None, "4"):
        if user_value is None:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", user_value)
        assert init_distributed("nccl")[:2] == (1, 2)
        assert seen[-1] == (user_value or "1")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    init_distributed("gloo")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ  # gloo ranks leave it alone
    assert grid_module.NCCL_ENVIRONMENT == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
