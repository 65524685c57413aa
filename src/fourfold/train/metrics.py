"""Training metrics: the metrics.jsonl writer, device peak FLOP/s for MFU, peak memory."""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch

from fourfold.config import cache_root, write_cache_json

# Dense peak FLOP/s per device: (bfloat16, tf32, float32). Matched on a substring of
# torch.cuda.get_device_name(); earlier entries win, so the more specific names come first.
GPU_PEAK_FLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("GH200", (989e12, 494.7e12, 66.9e12)),
    ("H200", (989e12, 494.7e12, 66.9e12)),
    ("H100 PCIe", (756e12, 378e12, 51.2e12)),
    ("H100", (989e12, 494.7e12, 66.9e12)),  # SXM
    ("A100", (312e12, 156e12, 19.5e12)),
    ("MI250X", (191.5e12, 47.9e12, 47.9e12)),  # one GCD (torch sees each GCD as a device)
    ("MI300X", (1307e12, 653.7e12, 163.4e12)),
    ("B200", (2250e12, 1100e12, 80e12)),
)

PROBE_SECONDS = 0.5


def gpu_peak_flops(device_name: str, dtype: str, tf32: bool) -> float | None:
    """Table peak for a known GPU name, or None."""
    for key, (bf16, tf32_peak, fp32) in GPU_PEAK_FLOPS:
        if key in device_name:
            if dtype == "bfloat16":
                return bf16
            return tf32_peak if tf32 else fp32
    return None


def measure_matmul_flops(device: torch.device, dtype: torch.dtype,
                         seconds: float = PROBE_SECONDS, size: int | None = None) -> float:
    """Achieved FLOP/s of square matmuls (size x size; by default 512 on a CPU, 1024 on an
    accelerator) on this device with the current thread count: the best of as many groups of
    four as fit in `seconds` (at least one)."""
    n = size or (1024 if device.type != "cpu" else 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # warm up kernels and thread pools
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        reps = 4
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2.0 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_flops(dtype: str, refresh: bool = False) -> float:
    """Peak FLOP/s of this CPU for `dtype`, measured once by a short matmul probe and cached
    in cache_root()/cpu_peak.json keyed by CPU model, thread count and dtype. A probe taken
    while the machine was busy reads low, so the cache keeps the highest figure seen, and
    `refresh` probes again (the trainer does when its MFU would exceed 100%)."""
    key = f"{_cpu_model()}|threads={torch.get_num_threads()}|{dtype}"
    path = cache_root() / "cpu_peak.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    known = cached.get(key) if isinstance(cached, dict) else None
    if isinstance(known, (int, float)) and not refresh:
        return float(known)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    peak = measure_matmul_flops(torch.device("cpu"), torch_dtype)
    if isinstance(known, (int, float)):
        peak = max(peak, float(known))
    cached = cached if isinstance(cached, dict) else {}
    cached[key] = peak
    write_cache_json(path, cached)
    return peak


def device_peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak FLOP/s of one device for training in `dtype` ("float32" or "bfloat16")."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        peak = gpu_peak_flops(name, dtype, tf32)
        if peak is None:  # an unknown GPU: measure it
            peak = measure_matmul_flops(device, torch.bfloat16 if dtype == "bfloat16"
                                        else torch.float32)
        return peak
    if device.type == "cpu":
        return cpu_peak_flops(dtype)
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated tensor memory on a GPU; on CPU the process's
    maximum resident set size (getrusage), which also counts Python and library memory."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux KiB


class MetricsLog:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl and, when asked and
    available, mirrors scalars to TensorBoard. Only the main rank should create one."""

    def __init__(self, path: Path, tensorboard_dir: Path | None = None, append: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = path.open("a" if append else "w")
        self._tb: Any = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                warnings.warn(f"train.tensorboard = true but TensorBoard is unavailable ({e}); "
                              "install the tensorboard package", stacklevel=2)
            else:
                self._tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path} is closed")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if key != "step" and is_number:
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
