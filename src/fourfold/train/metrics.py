"""Training metrics: the metrics.jsonl writer (and the trackers it feeds), the logging window,
the job's peak FLOP/s for MFU (from the planner's hardware catalog), peak memory."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch

from fourfold.plan.catalog import DEVICES, catalog_key_for_gpu
from fourfold.plan.machine_file import machine_for_torch_device
from fourfold.train.trackers import Tracker, scalars_of

PROBE_SECONDS = 0.5


def gpu_peak_flops(device_name: str, dtype: str, tf32: bool) -> float | None:
    """Peak FLOP/s of a GPU by the name torch gives it, from the one hardware catalog
    (fourfold.plan.catalog.DEVICES), or None for a GPU the catalog does not know."""
    key = catalog_key_for_gpu(device_name)
    return None if key is None else DEVICES[key].peak_flops(dtype, tf32)


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


def job_peak_flops(device: torch.device, dtype: str, world_size: int,
                   refresh: bool = False) -> float | None:
    """Peak FLOP/s of a job of `world_size` ranks on `device`s, the denominator of the logged
    MFU: the planner's `Machine.job_peak_flops` of the same catalog device (or, on a CPU, of
    the same probe), so logged and planned MFU agree. `refresh` probes the CPU again. An
    unknown GPU is measured; another device type gives None."""
    tf32 = device.type == "cuda" and bool(torch.backends.cuda.matmul.allow_tf32)
    machine = machine_for_torch_device(device, refresh)
    if machine is not None:
        return machine.job_peak_flops(dtype, world_size, tf32)
    if device.type == "cuda":
        return world_size * measure_matmul_flops(
            device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    return None


def proc_status_bytes(field_name: str) -> int:
    """A `kB` field of /proc/self/status (VmHWM, VmRSS) in bytes; 0 where there is none (no
    /proc: macOS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated tensor memory on a GPU; on CPU the process's
    peak resident set, which also counts Python and library memory. On Linux that is VmHWM
    (/proc/self/status), this program's own: getrusage's ru_maxrss survives fork and exec, so
    in a process that another started it read the parent's peak when that was larger (a child
    of a process holding 1 GiB: tests/test_train_metrics.py)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = proc_status_bytes("VmHWM")
    if hwm:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux KiB


class LogWindow:
    """The steps since the last log line: their tokens and seconds (for tokens/s) and their
    losses, whose mean is the logged loss (one step's loss is noisy; a plot of the means is
    not). A skipped step's NaN loss counts in neither."""

    def __init__(self) -> None:
        self.reset()

    def add(self, tokens: int, seconds: float, loss: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if math.isfinite(loss):
            self._loss_sum += loss
            self.loss_steps += 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def mean_loss(self) -> float:
        """The mean loss of the window's steps (NaN when none had a finite loss)."""
        return self._loss_sum / self.loss_steps if self.loss_steps else math.nan

    def reset(self) -> None:
        """Start the next window."""
        self.tokens, self.seconds = 0, 0.0
        self._loss_sum, self.loss_steps = 0.0, 0


class MetricsLog:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl and gives the scalars of
    every record but events to the experiment trackers (train/trackers.py). Only the main
    rank should create one."""

    def __init__(self, path: Path, trackers: Sequence[Tracker] = (), append: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = path.open("a" if append else "w")
        self._trackers = list(trackers)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path} is closed")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if "event" not in record:  # resumes, rollbacks, stragglers: metrics.jsonl only
            scalars = scalars_of(record)
            for tracker in list(self._trackers):
                try:
                    tracker.log(scalars, int(record.get("step", 0)))
                except Exception as e:  # a tracker's service or disk: the run goes on
                    self._trackers.remove(tracker)
                    warnings.warn(f"{type(tracker).__name__} failed ({type(e).__name__}: {e}); "
                                  "the run goes on without it (metrics.jsonl has every record)",
                                  stacklevel=2)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
