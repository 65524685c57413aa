"""Integer facts that grid checks, error messages and the planner's search share."""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    """The positive divisors of n >= 1, ascending (the sizes a grid axis over n can take)."""
    return [d for d in range(1, n + 1) if n % d == 0]
