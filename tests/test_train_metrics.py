"""Peak FLOP/s for MFU: the one hardware catalog, the one cached CPU probe, and logged MFU
agreeing with planned MFU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fourfold.config import ModelConfig
from fourfold.parallel.grid import GridShape
from fourfold.plan import host_probe
from fourfold.plan.catalog import Machine
from fourfold.plan.machine_file import load_machine
from fourfold.plan.memory import Precision
from fourfold.plan.perf import predict_step
from fourfold.train import metrics
from fourfold.train.metrics import gpu_peak_flops, job_peak_flops, peak_memory_bytes


def test_gpu_table_matches_device_names() -> None:
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16", tf32=False) == 989e12
    assert gpu_peak_flops("NVIDIA H200", "bfloat16", tf32=False) == 989e12
    assert gpu_peak_flops("NVIDIA GH200 480GB", "bfloat16", tf32=False) == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16", tf32=False) == 312e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "float32", tf32=False) == 19.5e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "float32", tf32=True) == 156e12
    assert gpu_peak_flops("AMD Instinct MI250X", "bfloat16", tf32=False) == 191.5e12
    assert gpu_peak_flops("AMD Instinct MI300X", "bfloat16", tf32=False) == 1307.4e12
    assert gpu_peak_flops("NVIDIA B200", "bfloat16", tf32=False) == 2250e12
    # the figures the two tables used to disagree on (see the catalog's comment)
    assert gpu_peak_flops("AMD Instinct MI250X", "float32", tf32=True) == 47.9e12
    assert gpu_peak_flops("NVIDIA B200", "float32", tf32=False) == 75e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bfloat16", tf32=False) == 756e12
    assert gpu_peak_flops("Some Future Accelerator", "bfloat16", tf32=False) is None


def _fake_cpu_probe(peaks: list[float], calls: list[float]):
    def probe() -> dict[str, object]:
        peak = peaks[len(calls) % len(peaks)]
        calls.append(peak)
        return {"peak_flops": peak, "gemm_half_dim": 64.0, "copy_bytes_per_s": 1e10,
                "rates": {}}
    return probe


def test_cpu_peak_is_the_planners_probe_measured_once_and_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOURFOLD_CACHE", str(tmp_path))
    calls: list[float] = []
    monkeypatch.setattr(host_probe, "_probe_cpu", _fake_cpu_probe([1.5e11, 1.0e11], calls))
    cpu = torch.device("cpu")
    assert job_peak_flops(cpu, "float32", 1) == 1.5e11
    assert job_peak_flops(cpu, "float32", 1) == 1.5e11
    assert job_peak_flops(cpu, "bfloat16", 1) == 1.5e11  # the probe is float32; bf16 assumed equal
    assert calls == [1.5e11]
    cached = json.loads((tmp_path / "plan" / "cpu_probe.json").read_text())
    assert cached["peak_flops"] == 1.5e11
    assert not (tmp_path / "cpu_peak.json").exists()  # no second cache
    # a rank runs one thread and a one-process run more: both read the same probe
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            assert job_peak_flops(cpu, "float32", 1) == 1.5e11
    finally:
        torch.set_num_threads(threads)
    assert calls == [1.5e11]
    # a refresh that measures lower (a busy host) keeps the higher figure
    assert job_peak_flops(cpu, "float32", 1, refresh=True) == 1.5e11
    assert calls == [1.5e11, 1.0e11]


TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)


def _planned_peak(machine: Machine, shape: GridShape, dtype: str) -> float:
    """The denominator the planner's MFU used: model FLOPs / (MFU x step time)."""
    pred = predict_step(TINY, shape, global_batch=8, seq_len=16, grad_accum=1,
                        activation_checkpointing=False, machine=machine,
                        precision=Precision.of(dtype))
    return pred.flops_per_step / (pred.mfu * pred.step_s)


@pytest.mark.parametrize("torch_name,catalog_key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("AMD Instinct MI250X", "mi250x-gcd"),
    ("NVIDIA B200", "b200")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logged_and_planned_mfu_share_one_denominator_on_a_gpu(
        torch_name: str, catalog_key: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: torch_name)
    shape = GridShape(data=2, z=1, y=2, x=2)
    logged = job_peak_flops(torch.device("cuda", 0), dtype, shape.size)
    planned = _planned_peak(load_machine(catalog_key), shape, dtype)
    assert logged == pytest.approx(planned, rel=1e-9)
    assert logged == shape.size * gpu_peak_flops(torch_name, dtype, tf32=False)


def test_logged_and_planned_mfu_share_one_denominator_on_the_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOURFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(host_probe, "_probe_cpu", _fake_cpu_probe([2e11], []))
    # a made-up host calibration: the denominator must not depend on it
    monkeypatch.setattr(host_probe, "host_calibration", lambda world, cores, gemm_half_dim:
                        host_probe.HostCalibration(world, cores, ((1, (1e-5, 1e-9)),),
                                                   1e10, 1e10, 1e-5))
    for world in (1, 2):
        shape = GridShape(data=world)
        logged = job_peak_flops(torch.device("cpu"), "float32", world)
        assert logged == pytest.approx(_planned_peak(load_machine("cpu"), shape, "float32"),
                                       rel=1e-9)


def test_matmul_probe_measures_something_plausible() -> None:
    flops = metrics.measure_matmul_flops(torch.device("cpu"), torch.float32, seconds=0.05)
    assert 1e8 < flops < 1e14


def test_peak_memory_on_cpu_is_the_resident_set() -> None:
    peak = peak_memory_bytes(torch.device("cpu"))
    # Bytes, not KiB: the interpreter and torch alone take more than 50 MiB, less than 64 GiB.
    assert 50 * 2**20 < peak < 64 * 2**30


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_peak_memory_on_cpu_is_the_process_own_not_its_launchers() -> None:
    """A process started by one that holds far more (as a launcher starts its ranks) reports
    its own peak: getrusage's ru_maxrss, which fork and exec keep, read the parent's."""
    import subprocess

    held = bytearray(1 << 30)
    for i in range(0, len(held), 4096):  # touch every page: resident
        held[i] = 1
    code = ("import torch\n"
            "from fourfold.train.metrics import peak_memory_bytes\n"
            "print(peak_memory_bytes(torch.device('cpu')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    child = int(out.stdout.split()[-1])
    assert 50 * 2**20 < child < len(held), child
