"""The planner: byte schedule, grid enumeration, ranking, memory, errors, CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from fourfold.config import ModelConfig, TrainConfig, model_config
from fourfold.models.llama import build_model
from fourfold.parallel.grid import GridShape
from fourfold.plan import (Overlap, PlanError, Precision, choose_grid, grid_shapes, load_machine,
                           plan, predict_comm_bytes, predict_param_memory, predict_step)
from fourfold.plan.cli import plan_main
from fourfold.plan.schedule import collective_schedule, local_param_numel

from fake_host import CPU_PROBE, comm_probe, use_fake_probes

TINY = ModelConfig(preset="custom", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                   vocab_size=96, max_seq_len=64)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch, request):
    monkeypatch.setenv("FOURFOLD_CACHE", str(tmp_path / "cache"))
    if request.node.get_closest_marker("ranks") is None:  # those run the real probes
        use_fake_probes(monkeypatch)  # the `cpu` machine without timing this CPU


def expected_bytes(cfg: ModelConfig, data: int, z: int, y: int, x: int, n: int, m: int,
                   ac: bool, ab: int, wb: int, gb: int, rb: int) -> dict[str, int]:
    """The ledger's bytes written out rule by rule from the engine's schedule (rb: bytes of
    the embedding's weight and output; gb: of gradient reductions)."""
    D, F, V, L = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers
    KV = cfg.n_kv_heads * (cfg.dim // cfg.n_heads)
    normal = [(D, D), (KV, D), (KV, D), (F, D), (F, D)]  # (out, in): q k v gate up
    transposed = [(D, D), (D, F)]  # o down
    replay = 2 if ac else 1
    bias = 0
    if cfg.bias:
        bias = L * (sum(o // y for o, _ in normal) + sum(o // x for o, _ in transposed))
    got = {"x": 0, "y": 0, "z": 0, "data": 0}
    if x > 1:
        per_layer = (replay * sum(n * o // y * ab for o, _ in normal)  # output all-reduces
                     + sum(n * i // y * ab for _, i in transposed)  # transposed dI
                     + replay * 2 * 4 * n + 2 * 4 * n)  # norms forward (+recompute), backward
        got["x"] = m * (L * per_layer + 2 * 4 * n + n * V // y * ab)  # final norm, output layer
    if y > 1:
        per_layer = replay * sum(n * o // x * ab for o, _ in transposed) + 2 * n * D // x * ab
        got["y"] = m * (L * per_layer + n * D // x * ab  # output layer's dI
                        + n * D // x * rb  # embedding
                        + 12 * n)  # loss
    if z > 1:
        block = sum(o * i for o, i in normal + transposed) // (x * y)
        # the output layer keeps its forward's block when D/x * wb <= n * (ab + 4)
        output_gathers = 1 if D // x * wb <= n * (ab + 4) else 2
        per_micro = (L * block * (2 * wb + gb)  # forward, then recompute or backward
                     + V * D // (x * y) * (rb + gb)  # embedding: gather, scatter
                     + V * D // (x * y) * (output_gathers * wb + gb))  # output layer
        got["z"] = m * per_micro + ((2 * L + 1) * D // x + bias) * gb
    if data > 1:
        sharded = L * sum(o * i for o, i in normal + transposed) + V * D * (
            1 if cfg.tie_embeddings else 2)
        got["data"] = (sharded // (x * y * z) + (2 * L + 1) * D // x + bias) * gb
    return got


GRIDS = [(1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1), (1, 2, 2, 2), (2, 2, 2, 2)]


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("variant", ["plain", "ac_accum_bf16", "ac_accum_small_weights",
                                     "bias_tied", "few_tokens_bf16_reduce"])
def test_comm_bytes_follow_the_engine_schedule(grid, variant):
    cfg, m, ac, ab, wb, gb, rb = TINY, 1, False, 4, 4, 4, None
    n = 2 * 16  # two sequences of 16 tokens per micro-step
    if variant == "ac_accum_bf16":  # as the engine runs bf16 autocast
        m, ac, ab, wb, rb = 3, True, 2, 2, 4
    if variant == "ac_accum_small_weights":
        m, ac, ab, wb, gb = 2, True, 2, 2, 2
    if variant == "bias_tied":
        cfg = ModelConfig(**{**TINY.__dict__, "bias": True, "tie_embeddings": True})
    if variant == "few_tokens_bf16_reduce":  # the output layer gathers again in backward
        n, ab, wb, gb, rb = 4, 2, 2, 2, 4
    data, z, y, x = grid
    got = predict_comm_bytes(cfg, GridShape(data=data, z=z, y=y, x=x), n, m, ac, ab, wb, gb,
                             residual_bytes=rb)
    assert got == expected_bytes(cfg, data, z, y, x, n, m, ac, ab, wb, gb,
                                 ab if rb is None else rb)
    for axis, size in zip(("data", "z", "y", "x"), grid):
        assert (got[axis] > 0) == (size > 1), axis


def test_comm_bytes_hand_computed_for_x2():
    # x = 2, n = 8 tokens, fp32, one micro-step; per layer: outputs of q,k,v,gate,up
    # 8*(32+16+16+64+64)*4 = 6144, transposed dI 8*(32+64)*4 = 3072, norms 4*(4*8) = 128;
    # two layers 18688, final norm 64, output layer 8*96*4 = 3072: 21824.
    got = predict_comm_bytes(TINY, GridShape(x=2), 8, 1, False)
    assert got == {"x": 21824, "y": 0, "z": 0, "data": 0}


def test_prediction_carries_the_same_bytes():
    machine = load_machine("perlmutter")
    shape = GridShape(data=2, z=2, y=1, x=2)
    pred = predict_step(TINY, shape, global_batch=8, seq_len=16, grad_accum=2,
                        activation_checkpointing=True, machine=machine,
                        precision=Precision.of("float32"))
    # 8 sequences over data*z = 4 shards, 2 micro-steps: 1 sequence of 16 tokens each
    assert pred.comm_bytes == predict_comm_bytes(TINY, shape, 16, 2, True)
    bf16 = predict_step(TINY, shape, 8, 16, 2, True, machine, Precision.of("bfloat16"))
    # the engine under bf16 autocast: bf16 weights gathered, bf16 GEMM outputs and input
    # gradients, fp32 embedding; gradients reduced in fp32 unless reduce_dtype says bf16
    assert bf16.comm_bytes == predict_comm_bytes(TINY, shape, 16, 2, True, act_bytes=2,
                                                 weight_bytes=2, grad_bytes=4, residual_bytes=4)
    assert bf16.comm_bytes["x"] < pred.comm_bytes["x"]
    assert bf16.comm_bytes["z"] < pred.comm_bytes["z"]
    bf16_reduce = predict_step(TINY, shape, 8, 16, 2, True, machine,
                               Precision.of("bfloat16", reduce_dtype="bfloat16"))
    assert bf16_reduce.comm_bytes["data"] * 2 == bf16.comm_bytes["data"]


def test_param_memory_matches_the_built_model():
    cfg = ModelConfig(**{**TINY.__dict__, "bias": True})
    model = build_model(cfg)
    for shape in (GridShape(), GridShape(data=2, z=2, y=2, x=2), GridShape(z=4, x=2)):
        local = 0
        for name, p in model.named_parameters():
            if p.ndim == 2:  # weights and embeddings: split over x, y and z
                local += p.numel() // shape.tensor_size
            elif "norm" in name:
                local += p.numel() // shape.x
            else:  # biases live where their layer's output does
                split = shape.x if name.split(".")[-2] in ("o_proj", "down_proj") else shape.y
                local += p.numel() // split
        mem = predict_param_memory(cfg, shape)
        assert mem == {"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local}


def all_factorizations(n: int) -> set[tuple[int, int, int, int]]:
    return {t for t in itertools.product(range(1, n + 1), repeat=4)
            if t[0] * t[1] * t[2] * t[3] == n}


@pytest.mark.parametrize("world", [6, 12])
def test_every_factorization_is_planned(world):
    # every size divisible by 12 so that every grid can split this model
    cfg = ModelConfig(preset="custom", n_layers=2, dim=144, n_heads=12, n_kv_heads=12,
                      ffn_dim=288, vocab_size=1440, max_seq_len=32)
    expected = all_factorizations(world)
    assert {(s.data, s.z, s.y, s.x) for s in grid_shapes(world)} == expected
    result = plan(cfg, world, load_machine("frontier"), global_batch=24, seq_len=32)
    planned = {(c.shape.data, c.shape.z, c.shape.y, c.shape.x) for c in result.candidates}
    assert planned == expected and not result.rejected


def test_grids_the_model_cannot_split_are_rejected_with_a_reason():
    result = plan(model_config("debug"), 6, load_machine("perlmutter"), global_batch=12,
                  seq_len=64)
    planned = {(c.shape.data, c.shape.z, c.shape.y, c.shape.x) for c in result.candidates}
    rejected = {(s.data, s.z, s.y, s.x) for s, _ in result.rejected}
    assert planned | rejected == all_factorizations(6) and not planned & rejected
    assert (2, 1, 3, 1) in rejected  # ffn_dim 512 does not split over y = 3
    assert all("divisible" in why for _, why in result.rejected)


def test_ranking_is_by_predicted_time():
    result = plan(model_config("350m"), 16, load_machine("perlmutter"), global_batch=64,
                  seq_len=1024)
    fitting = [c for c in result.candidates if c.fits]
    assert len(fitting) > 5
    times = [c.prediction.step_s for c in fitting]
    assert times == sorted(times)
    assert result.best is fitting[0]
    assert len({round(t, 9) for t in times}) > 1  # the grids are told apart


def test_overlap_hides_communication():
    cfg, machine = model_config("1b"), load_machine("perlmutter")
    shape = GridShape(data=2, z=4)
    args = (cfg, shape, 16, 2048, 2, False, machine, Precision.of("bfloat16"))
    on, off = predict_step(*args), predict_step(*args, overlap=Overlap(False, False, False, False))
    assert sum(off.hidden_s.values()) == 0 and sum(on.hidden_s.values()) > 0
    assert on.step_s < off.step_s
    assert on.comm_s == off.comm_s


def test_slower_network_means_slower_tensor_parallel_steps():
    cfg = model_config("1b")
    shape = GridShape(data=1, z=1, y=2, x=4)
    fast, slow = load_machine("dgx-h100"), load_machine("perlmutter")
    prec = Precision.of("bfloat16")
    t_fast = predict_step(cfg, shape, 8, 2048, 1, False, fast, prec)
    t_slow = predict_step(cfg, shape, 8, 2048, 1, False, slow, prec)
    assert t_slow.comm_s["x"] > t_fast.comm_s["x"] and t_slow.comm_s["y"] > t_fast.comm_s["y"]


def test_out_of_memory_detection():
    machine = load_machine("perlmutter")  # A100 40 GB
    big = plan(model_config("405b"), 8, machine, global_batch=8, seq_len=2048)
    assert not any(c.fits for c in big.candidates)
    assert big.best.oom_gib > 100  # 405B params x 16 bytes / 8 GPUs is ~750 GiB each
    with pytest.raises(PlanError, match="405b"):
        choose_grid(model_config("405b"), 8, machine, 8, 2048, dtype="bfloat16")
    small = plan(model_config("1b"), 8, machine, global_batch=32, seq_len=2048)
    assert small.best.fits
    shape, why = choose_grid(model_config("1b"), 8, machine, 32, 2048, dtype="bfloat16")
    assert shape.size == 8 and str(shape) in why and "ms/step" in why


def test_activation_checkpointing_saves_memory():
    machine = load_machine("perlmutter")
    cfg = model_config("1b")
    r_off = plan(cfg, 8, machine, 64, 4096, checkpointing=(False,), grad_accum=8)
    r_on = plan(cfg, 8, machine, 64, 4096, checkpointing=(True,), grad_accum=8)
    by_grid = {c.shape: c for c in r_on.candidates}
    for c in r_off.candidates:
        on = by_grid[c.shape]
        assert on.memory.activations < c.memory.activations
        assert on.prediction.compute_s > c.prediction.compute_s  # the recomputation


@pytest.mark.parametrize("call, named", [
    (lambda: plan_main(["--model", "gpt9", "--gpus", "8", "--machine", "perlmutter"]), "gpt9"),
    (lambda: plan_main(["--model", "1b", "--gpus", "8", "--machine", "summit"]), "summit"),
    (lambda: plan_main(["--model", "1b", "--gpus", "0", "--machine", "perlmutter"]), "0"),
    (lambda: plan(model_config("debug"), 7, load_machine("perlmutter"), 3, 64), "3"),
    (lambda: plan_main(["--model", "debug", "--gpus", "2", "--machine", "perlmutter",
                        "--global-batch", "0"]), "0"),
    (lambda: plan_main(["--model", "debug", "--gpus", "2", "--seq", "100000"]), "100000"),
    (lambda: plan_main(["--model", "debug", "--gpus", "2", "--bogus"]), "--bogus"),
    (lambda: plan_main(["--compute", "-5"]), "-5"),
    (lambda: plan_main(["--compute", "1e20", "--law", "kaplan"]), "kaplan"),
    (lambda: plan_main(["--dataset", "/nonexistent/data", "--compute", "1e20"]),
     "/nonexistent/data"),
])
def test_bad_input_is_one_clear_line(call, named):
    with pytest.raises(PlanError) as info:
        call()
    message = str(info.value)
    assert named in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_machine_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\nbase = "perlmutter"\ngpus_per_node = 8\n'
                    '[device]\ngemm_efficiency = 0.5\nmemory_gib = 80\n'
                    '[network]\nlatency_us = 3\n[network.stride_1]\n2 = 100\n8 = 50\n')
    m = load_machine(str(path))
    assert m.name == "mine" and m.gpus_per_node == 8
    assert m.device.gemm_efficiency == 0.5 and m.device.memory_gib == 80
    assert m.device.peak_bf16_tflops == 312.0  # kept from the base
    assert m.bandwidth_gbps(4, 1) == 100 and m.bandwidth_gbps(8, 1) == 50
    assert m.bandwidth_gbps(2, 16) == 100  # a single table serves every stride
    bad = tmp_path / "bad.toml"
    bad.write_text('gpus_per_node = 4\n[device]\nbase = "a100-40gb"\nflops = 3\n')
    with pytest.raises(PlanError, match="flops"):
        load_machine(str(bad))


def test_measured_bandwidth_tables():
    p, f = load_machine("perlmutter"), load_machine("frontier")
    assert [p.bandwidth_gbps(g, 1) for g in (2, 4, 8, 64)] == [76, 225, 80, 80]
    assert [p.bandwidth_gbps(g, 2) for g in (2, 4, 16)] == [76, 40, 40]
    assert p.bandwidth_gbps(2, 4) == 20 and p.bandwidth_gbps(8, 32) == 20
    assert [f.bandwidth_gbps(g, 1) for g in (2, 4, 8, 16)] == [129, 52, 135, 40]
    assert [f.bandwidth_gbps(g, 2) for g in (2, 4, 8)] == [50, 72, 20]
    assert [f.bandwidth_gbps(g, 4) for g in (2, 4)] == [36, 10]
    # stride >= 8: no table; a node's egress (10 GB/s x 4 rings at stride 4) over 8 rings
    assert f.bandwidth_gbps(2, 8) == 5 and f.bandwidth_gbps(16, 32) == 5
    # stride 3 (x = 3): the pair {6, 9} straddles two 8-GCD nodes, so the stride-2 table's
    # inter-node entry (20 GB/s, 2 rings per node) shared by 3 rings; was the in-node 50
    assert f.bandwidth_gbps(2, 3) == pytest.approx(20 * 2 / 3)
    h = load_machine("dgx-h100")
    assert h.bandwidth_gbps(8, 1) > h.bandwidth_gbps(2, 8)  # inside a node vs across nodes


def test_groups_that_leave_a_node_get_the_network_rate():
    from fourfold.plan.catalog import spans_nodes

    # 4 GPUs per node: x = 6 and x = 3 groups straddle nodes ({3, 4, 5}), x = 4 does not
    assert spans_nodes(6, 1, 4) and spans_nodes(3, 1, 4) and not spans_nodes(4, 1, 4)
    assert not spans_nodes(2, 2, 4) and spans_nodes(4, 2, 4) and spans_nodes(2, 4, 4)
    assert not spans_nodes(1, 64, 4) and not spans_nodes(2, 1, 2)
    p = load_machine("perlmutter")
    assert p.bandwidth_gbps(6, 1) == p.bandwidth_gbps(8, 1) == 80  # not NVLink's 225
    assert p.bandwidth_gbps(3, 2) == 40 and p.bandwidth_gbps(4, 1) == 225
    assert p.bandwidth_gbps(2, 8) == p.bandwidth_gbps(2, 4) == 20  # one ring per GPU already
    # without tables: the same rule picks intra or inter
    h = load_machine("dgx-h100")
    assert h.bandwidth_gbps(4, 2) == h.network.intra_node_gbps
    assert h.bandwidth_gbps(6, 1) == h.network.inter_node_gbps  # {6, ..., 11} on 8-GPU nodes


def test_all_reduce_latency_is_logarithmic_in_large_groups():
    from fourfold.plan.perf import collective_seconds
    from fourfold.plan.schedule import Collective

    machine = load_machine("perlmutter")
    lat = machine.network.latency_us * 1e-6
    small = Collective("data", "all_reduce", 4096, 1, "step_data")
    t = [collective_seconds(small, GridShape(data=p, z=1, y=1, x=1), machine)
         for p in (64, 1024)]
    # a tiny buffer: the tree's 2 log2(p) latency steps, not the ring's 2 (p - 1)
    assert t[0] == pytest.approx(12 * lat, rel=0.05) and t[1] == pytest.approx(20 * lat, rel=0.05)
    big = Collective("data", "all_reduce", 2**30, 1, "step_data")
    shape = GridShape(data=4, z=1, y=1, x=1)
    ring = 2 * 3 / 4 * 2**30 / (machine.bandwidth_gbps(4, 1) * 1e9) + 6 * lat
    assert collective_seconds(big, shape, machine) == pytest.approx(ring)  # bandwidth: ring
    gather = Collective("z", "all_gather", 4096, 1, "fwd_gather")  # rings only
    assert collective_seconds(gather, GridShape(data=1, z=64, y=1, x=1), machine) > 63 * lat


def test_ranks_on_one_host_share_its_memory():
    from fourfold.plan import host_probe
    from fourfold.plan.catalog import GIB, Device, Machine, Network

    host = Device("cpu", 1.0, 1.0, memory_gib=24.0, hbm_gbps=10.0, shared_host=True)
    # the cpu machine's gpus_per_node is its core count (2 here): 8 local ranks are not 4 nodes
    cpu = Machine("cpu", host, gpus_per_node=2, network=Network(), reserved_gib=0.5,
                  probe_host=host_probe.host_calibration)
    assert cpu.usable_memory_bytes(8) == pytest.approx((24 / 8 - 0.5) * GIB)
    assert cpu.usable_memory_bytes(1) == pytest.approx(23.5 * GIB)
    gpu = load_machine("perlmutter")
    assert gpu.usable_memory_bytes(8) == gpu.usable_memory_bytes(1024)  # one device per rank
    # a plan on 8 ranks rejects what fits in 11.3 GiB but not in 24 / 8 GiB
    big = ModelConfig(preset="custom", n_layers=2, dim=2048, n_heads=16, n_kv_heads=16,
                      ffn_dim=8192, vocab_size=32000, max_seq_len=128)
    result = plan(big, 8, cpu, 8, 128, "float32", checkpointing=(True,))
    fitting = [c for c in result.candidates if c.fits]
    assert all(c.memory.total <= 2.5 * GIB for c in fitting)
    assert any(2.5 * GIB < c.memory.total <= 11.5 * GIB for c in result.candidates)


def test_cpu_machine_is_measured_once(tmp_path, monkeypatch):
    from fourfold.plan import host_probe

    first = load_machine("cpu")
    assert first.device.peak_fp32_tflops == CPU_PROBE["peak_flops"] / 1e12
    assert first.device.shared_host and first.probed_host
    assert (tmp_path / "cache" / "plan" / "cpu_probe.json").is_file()

    def no_second_probe():
        raise AssertionError("measured again instead of using the cache")

    monkeypatch.setattr(host_probe, "_probe_cpu", no_second_probe)
    again = load_machine("CPU")
    assert again.device.peak_fp32_tflops == first.device.peak_fp32_tflops


def test_plan_main_json(capsys):
    assert plan_main(["--model", "1b", "--gpus", "8", "--machine", "perlmutter",
                      "--global-batch", "32", "--seq", "2048", "--json", "--top", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["configurations"]
    assert len(rows) == 20  # every factorization of 8 splits this model
    assert all(isinstance(r["fits"], bool) for r in rows)
    assert rows[0]["fits"]
    fit_times = [r["step_s"] for r in rows if r["fits"]]
    assert fit_times == sorted(fit_times)
    assert set(rows[0]["comm_s"]) == {"x", "y", "z", "data"}
    assert out["ranked_by"].startswith("step_s")
    for r in rows:  # HFU adds the recomputed forward, and only under checkpointing
        assert r["hfu"] > r["mfu"] if r["activation_checkpointing"] else r["hfu"] == r["mfu"]


def test_hfu_counts_the_recomputed_block_forward():
    from fourfold.models.llama import flops_per_token
    from fourfold.plan.perf import hardware_flops_per_token

    cfg = model_config("1b")
    model_flops = flops_per_token(cfg, 2048)
    assert hardware_flops_per_token(cfg, 2048, False) == model_flops
    # the blocks' forward is a third of their training FLOPs; the output layer's is not redone
    d, kv, L = cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_layers
    blocks = 6 * L * (2 * d * d + 2 * d * kv + 3 * d * cfg.ffn_dim) + 12 * L * d * 2048
    assert hardware_flops_per_token(cfg, 2048, True) == pytest.approx(model_flops + blocks / 3)
    shape = GridShape(data=2, z=2, y=1, x=2)
    machine = load_machine("perlmutter")
    p = predict_step(cfg, shape, 16, 2048, 1, True, machine, Precision.of("bfloat16"))
    assert p.hfu / p.mfu == pytest.approx(hardware_flops_per_token(cfg, 2048, True) / model_flops)


def test_custom_model_is_labelled_custom(tmp_path, capsys):
    preset_file = tmp_path / "plain.toml"
    preset_file.write_text('[model]\npreset = "15m"\n')
    changed = tmp_path / "wide.toml"
    changed.write_text('[model]\npreset = "15m"\ndim = 576\nn_heads = 12\nn_kv_heads = 12\n')
    no_preset = tmp_path / "mine.toml"
    no_preset.write_text('[model]\nn_layers = 3\ndim = 128\nn_heads = 4\nn_kv_heads = 4\n'
                         'ffn_dim = 256\nvocab_size = 256\n')
    names = {}
    for path in (preset_file, changed, no_preset):
        assert plan_main(["--model", str(path), "--gpus", "2", "--machine", "alps", "--json",
                          "--global-batch", "4", "--seq", "128"]) == 0
        names[path.name] = json.loads(capsys.readouterr().out)["model"]
    assert names["plain.toml"] == {**names["plain.toml"], "preset": "15m",
                                   "name": "15m (plain.toml)"}
    assert names["wide.toml"]["preset"] == "custom"
    assert names["wide.toml"]["name"] == "custom (wide.toml)"
    assert names["mine.toml"]["name"] == "custom (mine.toml)"
    assert plan_main(["--model", str(no_preset), "--gpus", "2", "--machine", "alps",
                      "--global-batch", "4", "--seq", "128"]) == 0
    assert capsys.readouterr().out.startswith("model custom (mine.toml)")


def test_plan_main_table(capsys):
    assert plan_main(["--model", "405b", "--gpus", "8", "--machine", "perlmutter",
                      "--global-batch", "8", "--seq", "2048", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "OOM by" in out and out.splitlines()[-1].startswith("no grid of 8 x A100-40GB fits: ")
    assert plan_main(["--model", "125m", "--gpus", "8", "--machine", "frontier",
                      "--global-batch", "16", "--seq", "512"]) == 0
    out = capsys.readouterr().out
    assert " fits" in out and "MI250X" in out


def test_plan_reads_a_config_file(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "15m"\n[train]\nbatch_size = 12\nseq_len = 128\n')
    assert plan_main(["--model", str(path), "--gpus", "4", "--machine", "alps", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["global_batch"] == 12 and out["seq_len"] == 128


def test_plan_labels_a_custom_model_file_with_its_name(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text("[model]\nn_layers = 8\ndim = 512\n")  # the default preset, reshaped
    assert plan_main(["--model", str(path), "--gpus", "2", "--machine", "dgx-h100"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("model custom (mine.toml) (") and "small" not in header
    assert plan_main(["--model", str(path), "--gpus", "2", "--machine", "dgx-h100",
                      "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["preset"] == "custom"
    same = tmp_path / "same.toml"
    same.write_text('[model]\npreset = "15m"\n')  # a preset as it is keeps its name
    assert plan_main(["--model", str(same), "--gpus", "2", "--machine", "dgx-h100"]) == 0
    assert capsys.readouterr().out.startswith("model 15m (")


def test_cpu_machine_fits_the_comm_probe_and_caches_it(tmp_path, monkeypatch):
    from fourfold.plan import host_probe

    calls = []

    def probe(world):
        calls.append(world)
        return comm_probe(1e-3, 2e-9)(world)

    monkeypatch.setattr(host_probe, "_run_comm_probe", probe)
    cpu = load_machine("cpu")
    cal = cpu.calibration(8)
    # the fit recovers the law the probe followed, per group size
    for p, (latency, per_byte) in cal.collective_fit:
        assert latency == pytest.approx(p * 1e-3) and per_byte == pytest.approx(2e-9)
    assert cal.collective_seconds("all_gather", 4, 8e6) == pytest.approx(4e-3 + 0.75 * 8e6 * 2e-9)
    assert cal.overlap_efficiency == 0.0  # 8 ranks on at most 8 cores: nothing spare to hide in
    assert (tmp_path / "cache" / "plan" / f"cpu_comm_8ranks_{cal.cores}cores.json").is_file()
    assert cpu.calibration(8) is cal  # fitted once per machine and world size
    assert calls == [8]
    assert load_machine("cpu").calibration(8) == cal  # a new machine reads the probe's file
    assert calls == [8]
    pred = predict_step(TINY, GridShape(z=8), 8, 16, 1, False, cpu, Precision.of("float32"))
    assert sum(pred.hidden_s.values()) == 0
    # every z collective costs its probed latency: 8 ms per call at least
    z_calls = sum(c.calls for c in collective_schedule(TINY, GridShape(z=8), 16, 1, False)
                  if c.axis == "z")
    assert pred.comm_s["z"] >= z_calls * 8e-3


def test_cpu_latency_moves_the_choice_away_from_many_small_collectives(tmp_path, monkeypatch):
    from fourfold.plan import host_probe

    prec = Precision.of("float32")
    grids = [GridShape(data=4), GridShape(z=4), GridShape(x=4)]

    def best(latency: float) -> GridShape:
        monkeypatch.setenv("FOURFOLD_CACHE", str(tmp_path / f"latency{latency}"))
        monkeypatch.setattr(host_probe, "_run_comm_probe", comm_probe(latency, 1e-9))
        cpu = load_machine("cpu")
        times = {s: predict_step(TINY, s, 8, 16, 1, False, cpu, prec).step_s for s in grids}
        return min(times, key=times.get)

    # data parallelism issues one collective per step, z and x dozens: latency favours data
    assert best(5e-3) == GridShape(data=4)


def test_overlap_forward_splits_the_output_all_reduces_and_hides_half():
    machine = load_machine("perlmutter")
    shape = GridShape(data=1, z=2, y=2, x=2)
    prec = Precision.of("bfloat16")
    plain = collective_schedule(TINY, shape, 32, 1, True, 2, 2, 4, 4)
    split = collective_schedule(TINY, shape, 32, 1, True, 2, 2, 4, 4, overlap_forward=True)
    # the same bytes, in twice the output all-reduce calls: half of them under a GEMM
    assert predict_comm_bytes(TINY, shape, 32, 1, True, 2, 2, 4, 4, overlap_forward=True) == \
        predict_comm_bytes(TINY, shape, 32, 1, True, 2, 2, 4, 4)
    gemm_outputs = sum(c.calls for c in plain if c.phase == "fwd_output" and c.nbytes > 12 * 32)
    # every one but the embedding's (a lookup, no GEMM to hide under)
    assert sum(c.calls for c in split if c.phase == "fwd_split") == gemm_outputs - 1
    # per block: q/k/v, o, gate/up, down: four output all-reduces, four z all-gathers
    per_block = [c for c in plain if c.axis in ("x", "y") and c.phase == "fwd_output"
                 and c.nbytes > 4 * 32 and c.calls == 2 * TINY.n_layers]  # with the recompute
    assert len(per_block) == 4
    args = (TINY, shape, 8, 16, 1, True, machine, prec)
    on = predict_step(*args, overlap=Overlap(overlap_forward=True))
    off = predict_step(*args)
    assert sum(on.hidden_s.values()) > sum(off.hidden_s.values())
    assert on.comm_bytes == off.comm_bytes


def test_search_over_reduce_dtype_and_overlap_forward_keeps_the_ledger_bytes(capsys):
    """Every candidate the search picks with --reduce-dtype auto --overlap-forward auto carries
    the bytes the engine's ledger records for its switches (the schedule test_parallel holds
    equal to the ledger), and the switches it chose are reported."""
    machine = load_machine("perlmutter")
    result = plan(TINY, 8, machine, 16, 16, "bfloat16", reduce_dtypes=("float32", "bfloat16"),
                  overlap_forward=(False, True))
    seen = set()
    for c in result.candidates:
        tokens = 16 // (c.shape.data * c.shape.z) // c.grad_accum * 16
        gb = 2 if c.reduce_dtype == "bfloat16" else 4
        assert c.prediction.comm_bytes == predict_comm_bytes(
            TINY, c.shape, tokens, c.grad_accum, c.activation_checkpointing, act_bytes=2,
            weight_bytes=2, grad_bytes=gb, residual_bytes=4,
            overlap_forward=c.overlap_forward), c.shape
        assert c.prediction.comm_bytes == expected_bytes(
            TINY, c.shape.data, c.shape.z, c.shape.y, c.shape.x, tokens, c.grad_accum,
            c.activation_checkpointing, 2, 2, gb, 4)
        seen.add(c.reduce_dtype)
    # bf16 reductions move half the gradient bytes: the search takes them where data/z > 1
    assert "bfloat16" in seen
    fixed = plan(TINY, 8, machine, 16, 16, "bfloat16")
    assert {c.reduce_dtype for c in fixed.candidates} == {"float32"}
    assert not any(c.overlap_forward for c in fixed.candidates)
    assert plan_main(["--model", "1b", "--gpus", "16", "--machine", "perlmutter", "--json",
                      "--global-batch", "64", "--seq", "2048", "--reduce-dtype", "auto",
                      "--overlap-forward", "auto", "--top", "0"]) == 0
    rows = json.loads(capsys.readouterr().out)["configurations"]
    assert {r["reduce_dtype"] for r in rows} <= {"float32", "bfloat16"}
    assert any(r["overlap_forward"] for r in rows)  # some grid's exposed all-reduces shrink
    assert plan_main(["--model", "1b", "--gpus", "16", "--machine", "perlmutter",
                      "--global-batch", "64", "--seq", "2048", "--overlap-forward", "on",
                      "--top", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = [line for line in table if line.split()[0] in ("1", "2")]
    assert " ovf " in table[5] and len(rows) == 2 and all(" on " in row for row in rows)
    assert "--set parallel.overlap_forward=true" in table[-1]  # the line that runs row 1
    with pytest.raises(PlanError, match="--no-overlap"):
        plan_main(["--model", "1b", "--gpus", "8", "--machine", "perlmutter", "--no-overlap",
                   "--overlap-forward", "on"])


def test_overlap_forward_pays_for_itself_only_where_all_reduces_are_exposed():
    machine, prec = load_machine("perlmutter"), Precision.of("bfloat16")
    cfg = model_config("1b")
    # x = 4: the output all-reduces wait in the open; the split hides half of them
    args = (cfg, GridShape(data=1, z=1, y=1, x=4), 4, 2048, 1, False, machine, prec)
    on, off = predict_step(*args, overlap=Overlap(overlap_forward=True)), predict_step(*args)
    assert on.step_s < off.step_s
    assert on.comm_s["x"] >= off.comm_s["x"]  # twice the calls: the latency is paid twice
    # data parallel only: no output all-reduce to hide, only smaller GEMMs and more launches
    args = (cfg, GridShape(data=4), 4, 2048, 1, False, machine, prec)
    on, off = predict_step(*args, overlap=Overlap(overlap_forward=True)), predict_step(*args)
    assert on.compute_s > off.compute_s and on.step_s >= off.step_s
    # the search takes the split only where it is faster
    result = plan(cfg, 4, machine, 4, 2048, "bfloat16", overlap_forward=(False, True))
    for c in result.candidates:
        other = predict_step(cfg, c.shape, 4, 2048, c.grad_accum, c.activation_checkpointing,
                             machine, prec, Overlap(overlap_forward=not c.overlap_forward))
        assert c.prediction.step_s <= other.step_s


def test_hidden_collectives_slow_the_compute_by_the_sms_they_hold(tmp_path):
    import dataclasses

    machine = load_machine("perlmutter")
    assert machine.device.comm_sm_fraction == pytest.approx(16 / 108)
    free = dataclasses.replace(machine, device=dataclasses.replace(machine.device, comm_sms=0.0))
    args = (model_config("1b"), GridShape(data=2, z=4), 16, 2048, 2, False)
    prec = Precision.of("bfloat16")
    charged, uncharged = predict_step(*args, machine, prec), predict_step(*args, free, prec)
    hidden = sum(charged.hidden_s.values())
    assert hidden > 0 and uncharged.contention_s == 0
    assert charged.contention_s == pytest.approx(hidden * 16 / 108)
    assert charged.step_s == pytest.approx(uncharged.step_s + charged.contention_s)
    # nothing hidden, nothing charged
    off = predict_step(*args, machine, prec, Overlap(False, False, False, False))
    assert off.contention_s == 0
    # the cpu machine's gloo overlap is priced by its probe, not by SMs
    assert load_machine("cpu").device.comm_sm_fraction == 0
    path = tmp_path / "nccl.toml"
    path.write_text('base = "perlmutter"\n[device]\nsm_count = 108\ncomm_sms = 8\n')
    assert load_machine(str(path)).device.comm_sm_fraction == pytest.approx(8 / 108)


@pytest.mark.ranks
def test_cpu_probe_times_compute_by_each_rank_and_feeds_the_calibration():
    """The real probe with 2 forked ranks: rates come from a window each rank times itself (so
    no barrier enters them), the element-wise and loss rates reach the calibration, and a
    calibration fitted to a job's own probe replaces the cached one."""
    from fourfold.plan import host_probe

    probe = host_probe.measure_cpu_comm(2, refresh=True)
    for key in ("matmul_flops", "copy_bytes_per_s", "elementwise_bytes_per_s"):
        assert probe[key] > 1e6, key
    assert 0 < probe["loss_s_per_logit"] < 1e-3 and 0 < probe["small_op_s"] < 0.1
    # causal attention: forward alone is cheaper than forward + backward, both per unit
    assert 0 < probe["attention_forward_s_per_unit"] < probe["attention_s_per_unit"] < 1e-6
    assert set(probe["comm"]) == {"all_reduce/2", "all_gather/2", "reduce_scatter/2"}
    cpu = load_machine("cpu")
    cal = host_probe.calibration_from_probe(probe, 2, 2, cpu.gpus_per_node,
                                            cpu.device.gemm_half_dim)
    assert cal.loss_s_per_logit == probe["loss_s_per_logit"]
    assert cal.elementwise_bytes_per_s == probe["elementwise_bytes_per_s"]
    slower = host_probe.calibration_from_probe({**probe, "loss_s_per_logit": 2e-3}, 2, 2,
                                               cpu.gpus_per_node, cpu.device.gemm_half_dim)
    args = (TINY, GridShape(data=2), 8, 16, 1, False)
    fast = predict_step(*args, cpu.calibrated(cal), Precision.of("float32"))
    slow = predict_step(*args, cpu.calibrated(slower), Precision.of("float32"))
    assert slow.compute_s > fast.compute_s  # the loss's probed cost is what the model charges
    # so is attention's: 10x its probed cost adds 9x the attention the model charged
    assert cal.attention_s_per_unit == probe["attention_s_per_unit"]
    ten = {k: 10 * probe[k] for k in ("attention_forward_s_per_unit", "attention_s_per_unit")}
    tenfold = host_probe.calibration_from_probe({**probe, **ten}, 2, 2, cpu.gpus_per_node,
                                                cpu.device.gemm_half_dim)
    slower_attention = predict_step(*args, cpu.calibrated(tenfold), Precision.of("float32"))
    units = 8 // 2 * TINY.n_heads * 16 * 16 * TINY.head_dim * TINY.n_layers  # per rank
    fwd, both = probe["attention_forward_s_per_unit"], probe["attention_s_per_unit"]
    # (backward is at least a forward's cost, should a busy host have squeezed it)
    assert slower_attention.compute_s - fast.compute_s == pytest.approx(
        9 * units * (fwd + max(both - fwd, fwd)), rel=1e-6)
    # mezo's noise: the generator's probed time per element is what a step's three passes cost
    assert 0 < probe["noise_s_per_element"] < 1e-6
    assert cal.noise_s_per_element == probe["noise_s_per_element"]
    doubled = host_probe.calibration_from_probe(
        {**probe, "noise_s_per_element": 2 * probe["noise_s_per_element"]}, 2, 2,
        cpu.gpus_per_node, cpu.device.gemm_half_dim)
    mezo = TrainConfig(optimizer="mezo")
    noisy = [predict_step(*args, cpu.calibrated(c), Precision.of("float32"), train=mezo)
             for c in (cal, doubled)]
    numel = sum(local_param_numel(TINY, GridShape(data=2)).values())
    assert noisy[1].compute_s - noisy[0].compute_s == pytest.approx(
        3 * numel * probe["noise_s_per_element"], rel=1e-6)
    with pytest.raises(PlanError, match="not probed"):
        load_machine("perlmutter").calibrated(cal)


@pytest.mark.slow  # a fresh interpreter runs the engine under torch.profiler
def test_elementwise_counts_are_the_engines() -> None:
    """The performance model's element-wise elements per token (plan/perf.py) against what
    torch.profiler counts in the engine's own ops (bench/elementwise_count.py, one process): a
    change to the blocks' element-wise work must show up in the model."""
    import re
    import subprocess
    import sys

    from fourfold.plan.perf import ELEMENTWISE_PER_TOKEN

    bench = Path(__file__).resolve().parent.parent / "bench"
    sys.path.insert(0, str(bench))
    from common import parse_table

    out = subprocess.run([sys.executable, str(bench / "elementwise_count.py"), "--dim", "128",
                          "--ffn", "384,768", "--batch", "4", "--seq", "64"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    measured = {row["pass"]: tuple(float(v) for v in re.fullmatch(
        r"([\d.]+) dim \+ ([\d.]+) ffn", row["measured"]).groups()) for row in parse_table(out)}
    fwd, bwd = ELEMENTWISE_PER_TOKEN["forward"], ELEMENTWISE_PER_TOKEN["backward"]
    # with kv = dim (n_kv_heads = n_heads), q + k + v is 3 dim wide
    model_fwd = (fwd["dim"] + 3 * fwd["qkv"], fwd["ffn"])
    model_both = (model_fwd[0] + bwd["dim"] + 3 * bwd["qkv"], fwd["ffn"] + bwd["ffn"])
    for (got_dim, got_ffn), (want_dim, want_ffn) in ((measured["forward"], model_fwd),
                                                     (measured["forward+backward"], model_both)):
        assert want_dim == pytest.approx(got_dim, rel=0.15)
        assert want_ffn == pytest.approx(got_ffn, rel=0.15)
