"""Integer facts that grid checks, error messages and the planner's search share."""

from __future__ import annotations

GIB = 1024**3  # bytes in a GiB: the unit of the planner's and the fits check's memory figures


def divisors(n: int) -> list[int]:
    """The positive divisors of n >= 1, ascending (the sizes a grid axis over n can take)."""
    return [d for d in range(1, n + 1) if n % d == 0]
