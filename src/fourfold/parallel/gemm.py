"""Matmul layout tuning, as in the paper: vendor BLAS can be much slower for some shapes in a
transposed mode than in the plain one. For each distinct GEMM of a linear layer (forward,
input gradient, weight gradient) and shape, the tuner times the equivalent layouts once, keeps
the fastest, and caches the choice per device on disk.

All ranks must compute replicated values identically, so the timings are summed over the whole
job before the choice (one tiny all-reduce per new shape, on the ledger under "all").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from fourfold.config import cache_root
from fourfold.parallel.comm import Comm

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Each kind computes one product; every variant returns the same values (up to rounding).
#   forward:     y  = x  @ w^T    (a = x (n, in), b = w (out, in))
#   input_grad:  dx = dy @ w      (a = dy (n, out), b = w (out, in))
#   weight_grad: dw = dy^T @ x    (a = dy (n, out), b = x (n, in))
VARIANTS: dict[str, list[tuple[str, Matmul]]] = {
    "forward": [
        ("a@bT", lambda a, b: a @ b.t()),
        ("a@contig(bT)", lambda a, b: a @ b.t().contiguous()),
        ("(b@aT)T", lambda a, b: (b @ a.t()).t().contiguous()),
    ],
    "input_grad": [
        ("a@b", lambda a, b: a @ b),
        ("(bT@aT)T", lambda a, b: (b.t() @ a.t()).t().contiguous()),
        ("a@contig(b)T.T", lambda a, b: a @ b.t().contiguous().t()),
    ],
    "weight_grad": [
        ("aT@b", lambda a, b: a.t() @ b),
        ("(bT@a)T", lambda a, b: (b.t() @ a).t().contiguous()),
        ("contig(aT)@b", lambda a, b: a.t().contiguous() @ b),
    ],
}


def default_cache_path(device: torch.device) -> Path:
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu-{torch.get_num_threads()}threads")
    return cache_root() / f"gemm-{name.replace(' ', '_')}.json"


class GemmTuner:
    """Chooses, per (kind, shape, dtype), the fastest of the equivalent matmul layouts."""

    def __init__(self, comm: Comm | None, cache_path: Path | None, repeats: int = 3) -> None:
        self.comm = comm
        self.cache_path = cache_path
        self.repeats = repeats
        self.choices: dict[str, int] = {}
        if cache_path is not None and cache_path.exists():
            try:
                self.choices = {k: int(v) for k, v in json.loads(cache_path.read_text()).items()}
            except (ValueError, OSError):
                self.choices = {}
        if comm is not None and comm.grid.world_size > 1:
            # every rank must make the same choices (and tune the same shapes together)
            shared = [self.choices]
            torch.distributed.broadcast_object_list(shared, src=0)
            self.choices = shared[0]

    @staticmethod
    def key(kind: str, a: torch.Tensor, b: torch.Tensor) -> str:
        return f"{kind}:{tuple(a.shape)}x{tuple(b.shape)}:{a.dtype}"

    def matmul(self, kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a2 = a.reshape(-1, a.shape[-1])
        b2 = b if kind != "weight_grad" else b.reshape(-1, b.shape[-1])
        key = self.key(kind, a2, b2)
        choice = self.choices.get(key)
        if choice is None:
            choice = self._tune(kind, key, a2, b2)
        out = VARIANTS[kind][choice][1](a2, b2)
        if kind == "weight_grad":
            return out
        return out.reshape(*a.shape[:-1], out.shape[-1])

    def _tune(self, kind: str, key: str, a: torch.Tensor, b: torch.Tensor) -> int:
        times = []
        for _, fn in VARIANTS[kind]:
            fn(a, b)  # warm-up
            _sync(a.device)
            start = time.perf_counter()
            for _ in range(self.repeats):
                fn(a, b)
            _sync(a.device)
            times.append(time.perf_counter() - start)
        t = torch.tensor(times, dtype=torch.float64)
        if self.comm is not None and self.comm.grid.world_size > 1:
            t = self.comm.all_reduce(t.to(self.comm.grid.device), "all").wait().cpu()
        choice = int(torch.argmin(t))
        self.choices[key] = choice
        self._save()
        return choice

    def _save(self) -> None:
        if self.cache_path is None or (self.comm is not None and not self.comm.grid.is_main):
            return
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.choices, indent=1, sort_keys=True))
            tmp.replace(self.cache_path)
        except OSError:
            pass  # a cache we cannot write only costs re-tuning next time


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_matmul(kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The untuned layouts (what the tuner's first variant computes)."""
    if kind == "forward":
        return torch.matmul(a, b.t())
    if kind == "input_grad":
        return torch.matmul(a, b)
    return torch.matmul(a.reshape(-1, a.shape[-1]).t(), b.reshape(-1, b.shape[-1]))
