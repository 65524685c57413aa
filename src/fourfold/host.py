"""This machine's CPU cores, and how ranks that share them split them.

Its own module so that the launcher, the process grid and the planner's probe of this host
can all ask without importing one another.
"""

from __future__ import annotations

import os


def cores_available() -> int:
    """CPU cores this process may run on (the affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(nproc: int, cores: int | None = None) -> int:
    """Ranks split the machine's cores: max(1, cores // nproc) threads each."""
    return max(1, (cores if cores is not None else cores_available()) // max(1, nproc))
