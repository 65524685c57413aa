"""Matmul tuning, as in the paper: a vendor BLAS can be much slower for some shapes in a
transposed mode than in the plain one, and on CPUs a second GEMM library can beat the first.
For each distinct GEMM of a linear layer (forward, input gradient, weight gradient) and shape,
the tuner times the equivalent ways once, keeps the fastest, and caches the choice per device
on disk, so later runs (and reruns, bit for bit) make the same choices.

The ways are the layouts of torch.matmul (MKL's sgemm for float32 on x86 CPUs, cuBLAS on GPUs)
and, on CPUs, oneDNN's matmul (the kernel torch.compile's CPU backend uses for linears), which
beats MKL for some shapes on some CPUs (which, the tuner finds out per shape).

All ranks must compute replicated values identically, so the timings are summed over the whole
job before the choice (one tiny all-reduce per new shape, on the ledger under "all").
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from fourfold.config import cache_root, write_cache_json
from fourfold.parallel.comm import Comm

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _onednn_linear(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T by oneDNN (a private op of PyTorch's CPU build; absent ops fail the variant)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


# Each kind computes one product; every variant returns the same values (up to rounding), as a
# contiguous tensor. Names starting "onednn:" run on CPU tensors only.
#   forward:     y  = x  @ w^T    (a = x (n, in), b = w (out, in))
#   input_grad:  dx = dy @ w      (a = dy (n, out), b = w (out, in))
#   weight_grad: dw = dy^T @ x    (a = dy (n, out), b = x (n, in))
VARIANTS: dict[str, list[tuple[str, Matmul]]] = {
    "forward": [
        ("a@bT", lambda a, b: a @ b.t()),
        ("a@contig(bT)", lambda a, b: a @ b.t().contiguous()),
        ("(b@aT)T", lambda a, b: (b @ a.t()).t().contiguous()),
        ("onednn:a@bT", lambda a, b: _onednn_linear(a, b)),
    ],
    "input_grad": [
        ("a@b", lambda a, b: a @ b),
        ("(bT@aT)T", lambda a, b: (b.t() @ a.t()).t().contiguous()),
        ("a@contig(b)T.T", lambda a, b: a @ b.t().contiguous().t()),
        ("onednn:a@b", lambda a, b: _onednn_linear(a, b.t())),
    ],
    "weight_grad": [
        ("aT@b", lambda a, b: a.t() @ b),
        ("(bT@a)T", lambda a, b: (b.t() @ a).t().contiguous()),
        ("contig(aT)@b", lambda a, b: a.t().contiguous() @ b),
        ("onednn:aT@b", lambda a, b: _onednn_linear(a.t(), b.t())),
        ("onednn:(bT@a)T", lambda a, b: _onednn_linear(b.t(), a.t()).t().contiguous()),
    ],
}
_BY_NAME = {kind: dict(variants) for kind, variants in VARIANTS.items()}


def variants_for(kind: str, device: torch.device) -> list[tuple[str, Matmul]]:
    """The variants of `kind` that can run on `device`."""
    return [(name, fn) for name, fn in VARIANTS[kind]
            if device.type == "cpu" or not name.startswith("onednn:")]


def default_cache_path(device: torch.device) -> Path:
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu-{torch.get_num_threads()}threads")
    return cache_root() / f"gemm-{name.replace(' ', '_')}.json"


class GemmTuner:
    """Chooses, per (kind, shape, dtype), the fastest of the equivalent matmuls.

    The token count (n) is keyed by the power of two at or above it, so generation, whose
    token count changes from call to call, tunes a few shapes, not one per prompt length."""

    def __init__(self, comm: Comm | None, cache_path: Path | None, repeats: int = 3) -> None:
        self.comm = comm
        self.cache_path = cache_path
        self.repeats = repeats
        self.choices: dict[str, str] = {}
        if cache_path is not None and cache_path.exists():
            try:
                saved = json.loads(cache_path.read_text())
                self.choices = {k: v for k, v in saved.items()
                                if v in _BY_NAME.get(k.split(":", 1)[0], {})}
            except (ValueError, OSError, AttributeError):
                self.choices = {}
        if comm is not None and comm.grid.world_size > 1:
            # every rank must make the same choices (and tune the same shapes together)
            shared = [self.choices]
            torch.distributed.broadcast_object_list(shared, src=0)
            self.choices = shared[0]

    @staticmethod
    def key(kind: str, a: torch.Tensor, b: torch.Tensor) -> str:
        """The cache key of a 2-D product; a's first dimension is the token count n."""
        n = 1 << max(a.shape[0] - 1, 0).bit_length()
        b_shape = (n, b.shape[1]) if kind == "weight_grad" else tuple(b.shape)
        return f"{kind}:{(n, a.shape[1])}x{b_shape}:{a.dtype}"

    def matmul(self, kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a2 = a.reshape(-1, a.shape[-1])
        b2 = b if kind != "weight_grad" else b.reshape(-1, b.shape[-1])
        key = self.key(kind, a2, b2)
        choice = self.choices.get(key)
        if choice is None:
            choice = self._tune(kind, key, a2, b2)
        out = _BY_NAME[kind][choice](a2, b2)
        if kind == "weight_grad":
            return out
        return out.reshape(*a.shape[:-1], out.shape[-1])

    def _tune(self, kind: str, key: str, a: torch.Tensor, b: torch.Tensor) -> str:
        """Time the variants in turns (one call each per round) and keep each one's fastest
        call, so that a machine whose speed drifts does not favour whichever ran first."""
        variants = variants_for(kind, a.device)
        runs = []
        for _, fn in variants:  # warm-up, and which variants run at all here
            try:
                fn(a, b)
                runs.append(True)
            except RuntimeError:  # e.g. a PyTorch build without oneDNN
                runs.append(False)
        best = [math.inf] * len(variants)
        for _ in range(self.repeats):
            for i, (_, fn) in enumerate(variants):
                if runs[i]:
                    _sync(a.device)
                    start = time.perf_counter()
                    fn(a, b)
                    _sync(a.device)
                    best[i] = min(best[i], time.perf_counter() - start)
        t = torch.tensor(best, dtype=torch.float64)
        if self.comm is not None and self.comm.grid.world_size > 1:
            t = self.comm.all_reduce(t.to(self.comm.grid.device), "all").wait().cpu()
        choice = variants[int(torch.argmin(t))][0]
        self.choices[key] = choice
        self._save()
        return choice

    def _save(self) -> None:
        if self.cache_path is not None and (self.comm is None or self.comm.grid.is_main):
            write_cache_json(self.cache_path, self.choices)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_matmul(kind: str, a: torch.Tensor, b: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The untuned layouts (what the tuner's first variant computes); a weight gradient into
    `out` where given (its shape and dtype)."""
    if kind == "forward":
        return torch.matmul(a, b.t())
    if kind == "input_grad":
        return torch.matmul(a, b)
    return torch.matmul(a.reshape(-1, a.shape[-1]).t(), b.reshape(-1, b.shape[-1]), out=out)
