"""Keep freed host memory in the process instead of handing it back to the kernel.

PyTorch has a caching allocator for GPU memory but not for CPU tensors: every activation,
gradient and logits tensor of a CPU training step is a fresh `malloc`, and glibc serves big
ones with `mmap` and returns them with `munmap` (or trims its heap) when they are freed. The
next step then touches brand-new pages, and the kernel zero-fills each 4 KiB page on its first
touch. On the 35M-parameter bench shape that was about 160,000 page faults per step (640 MiB of
zero-filled memory) and about a tenth of the step's time.

`keep_freed_host_memory()` tells glibc to behave like a caching allocator: serve every block,
however big, from its heap (no `mmap`), grow the heap in large steps and never trim it. After a
few steps the heap has grown to the step's peak and settled its layout, and later steps reuse
it: no page faults (on the bench shape 0-5 per step from the third step on).
(Raising the mmap threshold instead is not enough: its ceiling is 32 MiB, below a logits
tensor, and big blocks then come from the heap only if it happens to have grown after the
tuning.) The price is that the process keeps its peak host memory until it exits, which is
what a training process does anyway.

A heap that keeps everything must also let freed neighbours merge, or it grows far beyond what
the process holds. torch allocates CPU tensors 64-byte aligned (posix_memalign), and glibc cuts
the alignment padding off each block as a tiny free chunk; kept in a fastbin or the tcache,
such chunks count as in use and sit between the big blocks, so freed blocks never coalesce into
holes that a later, slightly larger tensor fits. Measured on the 350m preset, 8 ranks: a rank's
resident memory reached 1.3-1.5x the model's weights while it held at most 0.8x. So fastbins
are off (M_MXFAST = 0), all threads share one arena (gloo's worker threads would each keep
their own peak), and ranks started by `fourfold train --nproc` also run without the tcache
(`RANK_TUNABLES`, which only the environment can set); then a rank's resident memory stays
within a few percent of what it holds, without page faults (bench/memory.py --phases). The
tcache matters most: with the in-process part alone the 350m ranks still read 1.1-1.4x, so
any other CPU process of `fourfold train` (a rank that torchrun or srun started, or one
process without a launcher) restarts itself once with RANK_TUNABLES (fourfold.cli); one
process of 15m at 8 x 128 tokens peaked 16-52 MiB lower so (MiB above the import, without ->
with: AdamW 488 -> 472, LOMO 262 -> 210, MeZO 125 -> 112, GaLore 301 -> 254).

The same environment turns MKL's buffer cache off (fourfold.host.MKL_ENVIRONMENT): MKL, which
does torch's GEMMs and eigh on x86 CPUs, otherwise keeps each call's work buffers in the heap
for good, 23 MiB after one GaLore refresh of a 288-row matrix. At 15m, 8 x 128 tokens
(bench/train_memory.py, one run each, MiB above the import, without -> with): GaLore one
process 245 -> 223, 2x2 rank 0 138 -> 126; AdamW one process 417 -> 401; LOMO 2x2 115 -> 109.

And it turns torch's flight recorder off (fourfold.host.FLIGHT_RECORDER_ENVIRONMENT), whose
small blocks, made at every collective and kept until its ring comes round, landed in the
holes a step's tensors left on a CPU rank of a grid (15m 2x2: ES 62-67 -> 50 MiB, AdaLomo 121
-> 106).

It only changes glibc's tuning (`mallopt`); on other C libraries, or when the user tunes malloc
through the environment (MALLOC_* variables or GLIBC_TUNABLES), it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable

import torch

from fourfold.host import (_TOP_PAD, _TRIM_THRESHOLD, RANK_TUNABLES,  # noqa: F401
                           _user_tunes_malloc, rank_malloc_environment)

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


def trim_host_memory(device: torch.device) -> None:
    """When `device` is the host, hand the heap's free pages back to the kernel now (glibc's
    malloc_trim, which frees whole free pages in the middle of the heap too): under the ranks'
    malloc tuning nothing else does. Called after the training steps, whose blocks the final
    export will not reuse, before a GaLore refresh's large transient, which would otherwise
    land beside resident holes, and on a CPU rank of a grid at the points trim_on_host_grid
    lists. A no-op for an accelerator's memory and off glibc."""
    if device.type != "cpu":
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def trim_after_autocast_forward(device: torch.device, world_size: int,
                                dtype: str) -> Callable[[], None] | None:
    """What a memory-lean method runs between a forward and its backward (adamw.backward_pass's
    `after_forward`): on one host process under bfloat16 autocast, the trim. Autocast caches
    every weight's bfloat16 copy through the forward and frees them all as it ends (on a grid
    Linear3D casts its own weights: no cache); the backward's first large tensors (the output
    layer's float32 dW, the weight's bfloat16 copy) fit none of the copies' holes and land on
    top of them, all resident. 125m, 2 x 128 tokens, --tuned-malloc (bench/memory_lean.py
    --dtype bfloat16): LOMO 919-933 MiB without, 845-849 with, at 145-146 tokens/s against
    151-152; AdaLomo 921-927 against 844; GaLore 1235-1239 against 1207-1208. AdamW would save
    57 MiB of 2300 at 12% of its tokens/s and BlockLLM nothing: they do not trim."""
    if device.type != "cpu" or world_size != 1 or dtype != "bfloat16":
        return None
    return functools.partial(trim_host_memory, device)


def trim_on_host_grid(device: torch.device, world_size: int) -> Callable[[], None] | None:
    """The methods' per-step trim, for a CPU rank of a grid (else None): LOMO and AdaLomo at
    each step's start, GaLore at its forward and its update, MeZO and ES before each forward,
    BlockLLM at each step's start. On such a rank a step's transients (with MKL's cache off a
    4.6-4.8 MiB work buffer per float32 GEMM; until stop 49 also a 4 MiB logits block that
    gloo's worker thread freed a moment after the next one was made, see embedding.py's
    _block_space) land in other holes each step: the heap in use stays flat, but its blocks
    wander over a growing extent and every page they touch stays resident. 15m preset, 2x2, 8 x
    128 tokens, 12 steps (bench/train_memory.py --grids 2x2 --steps 12), rank 0's peak without
    -> with (four runs against eight, ES fourteen): ES 68-93 -> 64-86 MiB (median 68.5; with
    stop 49's logits buffer 60-79, median 64.6 over nineteen), MeZO 67-78 -> 62-71 (planned
    61.5); BlockLLM 132-136 -> 116-124 (four, four; planned 108). The price is the faults of
    the pages touched again: on that rank a step +2% (AdaLomo, GaLore) to +7% (MeZO)
    (bench/trim_cost.py --grid 2x2). One process does not grow so, and there the trims bought
    nothing and cost 9-13% of a step (LOMO, AdaLomo, GaLore at 15m; LOMO 164 against 176
    tokens/s at 125m, peak 690 against 688 MiB, one run each): no trim there."""
    if device.type != "cpu" or world_size == 1:
        return None
    return functools.partial(trim_host_memory, device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor (a batch) on `device`. To a GPU it goes through pinned memory without
    blocking the host, so the copy overlaps what the GPU is still doing; elsewhere, `t.to`."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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
