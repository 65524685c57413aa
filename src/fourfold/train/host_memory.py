"""The host-memory policy of a run: what fourfold does about the C allocator when tensors live
in host memory (a CPU run), decided once in build_run and a no-op on a GPU.

PyTorch has a caching allocator for GPU memory but not for CPU tensors: every activation,
gradient and logits tensor of a CPU step is a fresh `malloc`, which glibc serves with `mmap`
(big blocks) or from its heap, and hands back to the kernel when freed. The next step then
touches new pages, each zero-filled by the kernel on its first touch: a tenth of a step's time
on a small model. The policy:
- tunes glibc to behave as a caching allocator (`keep_freed_host_memory`): every block from
  its heap, grown in large steps and never trimmed, fastbins off and one arena, so that freed
  neighbours merge into holes a later tensor fits; the ranks a launcher starts get the same
  tuning through their environment (fourfold.host.rank_malloc_environment), with the
  per-thread cache off, which only the environment can set, MKL's buffer cache off and torch's
  flight recorder off (both leave blocks in the holes a step's tensors free);
- hands the heap's free pages back to the kernel at the points where what comes next would
  otherwise land beside resident holes (`HostMemory.hooks`: the training method's phase
  boundaries; `release`: before the export);
- gives the engine a pool that keeps a released gradient's buffer for the next gradient of
  its shape (parallel/buffers.py), where fresh gradients would each find the heap's holes
  taken by the activations made since.
bench/memory_lean.py (--cli, --tuned-malloc) measures a run's peak resident memory per rank
(the figures: docs/results.md); tests/test_host_memory.py checks what each part does to the
heap.
Off glibc, or when the user tunes malloc through the environment (MALLOC_* variables or
GLIBC_TUNABLES), the tuning does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fourfold.host import (_TOP_PAD, _TRIM_THRESHOLD, RANK_TUNABLES,  # noqa: F401
                           _user_tunes_malloc, rank_malloc_environment)
from fourfold.parallel.buffers import GradBufferPool
from fourfold.train.methods.base import PhaseHooks

# mallopt parameters (malloc.h)
_M_MXFAST = 1
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


_done = False


def keep_freed_host_memory() -> bool:
    """Tune glibc malloc to reuse freed memory (see the module docstring). Returns whether
    it did (or the process started with RANK_TUNABLES); safe to call more than once."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or _user_tunes_malloc():
        return False
    if os.environ.get("GLIBC_TUNABLES") == RANK_TUNABLES:
        _done = True
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD), (_M_TOP_PAD, _TOP_PAD),
        (_M_MMAP_MAX, 0), (_M_MXFAST, 0), (_M_ARENA_MAX, 1)))
    _done = ok
    return ok


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, looked up once (finding libc runs ldconfig: milliseconds)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


def trim_host_memory() -> None:
    """Hand the heap's free pages back to the kernel now (glibc's malloc_trim, which frees
    whole free pages in the middle of the heap too): under the tuning above nothing else does.
    Nothing off glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class HostMemory:
    """The host-memory policy of one run (see the module docstring): `on_host` (the tensors
    live in host memory), on `world_size` ranks, computing in `dtype`."""

    on_host: bool
    world_size: int = 1
    dtype: str = "float32"

    @classmethod
    def for_run(cls, device: torch.device, world_size: int, dtype: str) -> HostMemory:
        return cls(device.type == "cpu", world_size, dtype)

    def tune(self) -> None:
        """Tune the allocator of this process (once, before the model is built)."""
        if self.on_host:
            keep_freed_host_memory()

    def release(self) -> None:
        """Hand the heap's free pages back now (before a phase whose blocks the last one's
        holes would not fit: the export after the steps)."""
        if self.on_host:
            trim_host_memory()

    def hooks(self) -> PhaseHooks:
        """What the training method calls at its phases' boundaries:
        - before a large transient (a GaLore refresh's Gram and eigh workspace), on any host
          process: it would otherwise land above the heap's free holes, all resident;
        - on a CPU rank of a grid, at each step's start, before each forward of a
          forward-only method and before the update: there a step's transients (a GEMM's work
          buffer, a block of logits gloo's worker thread frees late) land in other holes each
          step, and the pages their blocks wander over stay resident;
        - on one host process under bfloat16 autocast, between forward and backward: autocast
          frees its cached bfloat16 weight copies as the forward ends, and the backward's
          first large tensors fit none of their holes.
        On a GPU none."""
        if not self.on_host:
            return PhaseHooks()
        release = self.release
        if self.world_size > 1:
            return PhaseHooks(step_start=release, before_forward=release,
                              before_update=release, before_transient=release)
        if self.dtype == "bfloat16":
            return PhaseHooks(after_forward=release, before_transient=release)
        return PhaseHooks(before_transient=release)

    def grad_buffers(self) -> GradBufferPool | None:
        """The engine's pool of released gradient buffers: on a host, where a fresh gradient
        is a fresh malloc (a GPU's caching allocator reuses its blocks itself)."""
        return GradBufferPool() if self.on_host else None


def to_host(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """A CPU version of `t` for a checkpoint snapshot (`copy`: never `t` itself). From a GPU
    the copy lands in pinned memory without blocking: synchronise (`wait_for_host_copies`)
    before reading it."""
    if t.device.type != "cuda":
        return t.detach().to("cpu", copy=copy)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t.detach(), non_blocking=True)


def wait_for_host_copies(device: torch.device) -> None:
    """Wait for the copies `to_host` started from `device` (one sync per snapshot, not one per
    tensor); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
