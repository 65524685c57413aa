"""This machine's CPU cores, and how ranks that share them split them.

Its own module so that the launcher, the process grid and the planner's probe of this host
can all ask without importing one another.
"""

from __future__ import annotations

import os
import sys


def cores_available() -> int:
    """CPU cores this process may run on (the affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(nproc: int, cores: int | None = None) -> int:
    """Ranks split the machine's cores: max(1, cores // nproc) threads each."""
    return max(1, (cores if cores is not None else cores_available()) // max(1, nproc))


# glibc malloc tuning for CPU ranks (train/host_memory.py says why), here without torch so that
# the command line can act on it before anything is imported.
_TOP_PAD = 1 << 30  # grow the heap 1 GiB at a time (virtual: untouched pages cost nothing)
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the largest, i.e. never trim in practice

# The same tuning as glibc tunables, read once at a process's start: what the local launcher
# (fourfold train --nproc) gives its CPU ranks, and what any other CPU process of `fourfold
# train` restarts itself with (fourfold.cli), since the tcache (a per-thread cache of small
# chunks) can only be switched off this way.
RANK_TUNABLES = ":".join([
    "glibc.malloc.mmap_max=0", f"glibc.malloc.trim_threshold={_TRIM_THRESHOLD}",
    f"glibc.malloc.top_pad={_TOP_PAD}", "glibc.malloc.mxfast=0", "glibc.malloc.tcache_count=0",
    "glibc.malloc.arena_max=1"])


def _user_tunes_malloc() -> bool:
    return any(name.startswith("MALLOC_") for name in os.environ) or (
        "GLIBC_TUNABLES" in os.environ and os.environ["GLIBC_TUNABLES"] != RANK_TUNABLES)


# MKL (torch's BLAS and LAPACK on x86 CPUs) keeps the work buffers of its calls for reuse, in
# the heap, for the process's life: 5 MiB after one float64 GEMM of a GaLore Gram's size, 23
# after an eigh of 288 x 288, 27 MiB more at the peak of a 15m forward and backward (one
# process, 8 x 128 tokens) than without. Its variable MKL_DISABLE_FAST_MM, read when MKL
# starts, makes it free them after each call; under RANK_TUNABLES the next call's malloc takes
# the same heap pages again, so nothing is faulted in anew (the 15m forward and backward: no
# slower, a median 0.87 of the time with the cache over 5 alternated runs, on a busy host).
# The price: each float32 GEMM then mallocs and frees a work buffer of 4.6-4.8 MiB, which
# where no hole of that size is left extends the heap's top (an ES 2 x 2 rank at 15m: by 0.5-4
# MiB at a time over its first ~5 steps, then no more); with the cache on, that rank's heap held
# 13 MiB more in use and its resident peak was no lower (16 steps, two runs against one).
MKL_ENVIRONMENT = {"MKL_DISABLE_FAST_MM": "1"}

# torch's flight recorder, on for gloo in torch 2.13 unless this variable is 0, keeps a ring of
# recent collectives for debugging hangs: each collective leaves a few small blocks (about 700
# bytes) that live until the ring comes round (it stops growing within 2,000 collectives),
# carved out of the holes a step's tensors left. On a CPU rank of a grid that scatters the
# heap and raises the rank's peak (bench/memory_lean.py --cli measures a rank's peak; figures
# in docs/results.md). Set, as the rest, before the rank starts; fourfold's own collective
# errors already name the axis and ranks.
FLIGHT_RECORDER_ENVIRONMENT = {"TORCH_FR_BUFFER_SIZE": "0"}


def rank_malloc_environment() -> dict[str, str]:
    """Environment for CPU ranks that a launcher starts: RANK_TUNABLES as GLIBC_TUNABLES, MKL's
    buffer cache off (MKL_ENVIRONMENT) and torch's flight recorder off
    (FLIGHT_RECORDER_ENVIRONMENT), each variable unless the user set it; nothing when the user
    tunes malloc."""
    if not sys.platform.startswith("linux") or _user_tunes_malloc():
        return {}
    rest = {**MKL_ENVIRONMENT, **FLIGHT_RECORDER_ENVIRONMENT}
    return {"GLIBC_TUNABLES": RANK_TUNABLES,
            **{k: v for k, v in rest.items() if k not in os.environ}}


def restart_for_cpu_training(argv: list[str]) -> None:
    """`fourfold train` (`argv`: the command line) on a host without GPUs execs itself once
    more with the environment a launcher gives CPU ranks (rank_malloc_environment), which
    glibc and MKL read only at a process's start: a rank that torchrun or srun started, and one
    process as well, run as fourfold's own launcher's ranks do. Before torch is imported (the
    command line's own imports take milliseconds). Nothing happens for another command, when
    the user tunes malloc, off Linux, on a host with GPUs, or in the restarted process."""
    if argv[1:2] != ["train"] or "GLIBC_TUNABLES" in os.environ or has_accelerator_devices():
        return
    extra = rank_malloc_environment()
    if not extra:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "fourfold", *argv[1:]],
              {**os.environ, **extra})


def has_accelerator_devices() -> bool:
    """Whether this host shows GPU device files (NVIDIA or AMD), read without importing torch."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd"))
