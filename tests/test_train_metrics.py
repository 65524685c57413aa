"""Peak FLOP/s for MFU: the GPU table and the cached CPU probe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fourfold.train import metrics
from fourfold.train.metrics import cpu_peak_flops, gpu_peak_flops, peak_memory_bytes


def test_gpu_table_matches_device_names() -> None:
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16", tf32=False) == 989e12
    assert gpu_peak_flops("NVIDIA H200", "bfloat16", tf32=False) == 989e12
    assert gpu_peak_flops("NVIDIA GH200 480GB", "bfloat16", tf32=False) == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16", tf32=False) == 312e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "float32", tf32=False) == 19.5e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "float32", tf32=True) == 156e12
    assert gpu_peak_flops("AMD Instinct MI250X", "bfloat16", tf32=False) == 191.5e12
    assert gpu_peak_flops("AMD Instinct MI300X", "bfloat16", tf32=False) == 1307e12
    assert gpu_peak_flops("NVIDIA B200", "bfloat16", tf32=False) == 2250e12
    assert gpu_peak_flops("Some Future Accelerator", "bfloat16", tf32=False) is None


def test_cpu_peak_is_measured_once_and_cached(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOURFOLD_CACHE", str(tmp_path))
    calls: list[torch.dtype] = []

    def fake_probe(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
        calls.append(dtype)
        return 1.5e11

    monkeypatch.setattr(metrics, "measure_matmul_flops", fake_probe)
    assert cpu_peak_flops("float32") == 1.5e11
    assert cpu_peak_flops("float32") == 1.5e11
    assert cpu_peak_flops("bfloat16") == 1.5e11
    assert calls == [torch.float32, torch.bfloat16]
    cached = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert sorted(k.rsplit("|", 1)[1] for k in cached) == ["bfloat16", "float32"]
    assert all(f"threads={torch.get_num_threads()}" in k for k in cached)


def test_matmul_probe_measures_something_plausible() -> None:
    flops = metrics.measure_matmul_flops(torch.device("cpu"), torch.float32, seconds=0.05)
    assert 1e8 < flops < 1e14


def test_peak_memory_on_cpu_is_the_resident_set() -> None:
    peak = peak_memory_bytes(torch.device("cpu"))
    # Bytes, not KiB: the interpreter and torch alone take more than 50 MiB, less than 64 GiB.
    assert 50 * 2**20 < peak < 64 * 2**30
