"""Spreading a global batch of packed rows over data shards and micro-batches by their cost.

A packed row's work is its tokens' (the GEMMs, norms and the loss: the same for every row of
seq_len positions) plus its attention, which grows with the square of each document's length:
a row holding one 1024-token document does 4x the attention work of one holding four of 256.
Rows dealt out in order leave the shards that drew the long documents to finish last while the
others wait at the next collective. Shards of one step meet only at the gradient all-reduce, so
what must be even is each shard's total: the loader first puts every global batch's rows into
`shards` bins of equal size, the most expensive row first into the cheapest bin (longest
processing time first), then swaps rows between the dearest and the cheapest bin while that
narrows them; then splits each shard's rows over its micro-batches the same way. A split that
does not beat the order the rows came in (few rows a bin leave little to choose from) keeps
that order. The global batch is the same rows, so the step's loss and gradients are one
process's (summed in another order).

The cost model's weight of the attention term against the tokens' comes from the planner
(plan/perf.py `sequence_cost`); SequenceCost() counts tokens alone.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

SWAP_ROUNDS = 64  # improvement swaps per batch at most (each narrows the widest gap)


@dataclass(frozen=True)
class SequenceCost:
    """The work of a packed row: `token` per position plus `square` per squared document
    length, in any unit (only ratios matter)."""

    token: float = 1.0
    square: float = 0.0

    def row(self, document_lengths: Sequence[int] | np.ndarray) -> float:
        lengths = np.asarray(document_lengths, dtype=np.float64)
        return float(self.token * lengths.sum() + self.square * (lengths * lengths).sum())


def balanced_order(costs: np.ndarray, shards: int, micro_batches: int) -> np.ndarray:
    """A permutation of a global batch's rows (by index) such that shard s, rows [s * n /
    shards, (s + 1) * n / shards) of the permuted batch, costs about the same for every s, and
    within it micro-batch m, the m-th of its `micro_batches` equal slices, too. Never less even
    than the rows' own order, over shards and over each shard's micro-batches. Deterministic:
    every rank computes the same order from the same costs."""
    n = len(costs)
    if n % (shards * micro_batches):
        raise ValueError(f"{n} rows do not split into {shards} shards x {micro_batches} "
                         "micro-batches")
    costs = np.asarray(costs, dtype=np.float64)
    return np.concatenate([shard[_even_split(costs[shard], micro_batches)]
                           for shard in np.split(_even_split(costs, shards), shards)])


def _even_split(costs: np.ndarray, bins: int) -> np.ndarray:
    """An order of `costs`' indices whose `bins` equal slices cost about the same, or their own
    order where that is at least as even."""
    n = len(costs)
    in_order = np.arange(n)
    if bins == 1:
        return in_order
    members = _longest_first(costs, bins, n // bins)
    _swap_down(costs, members)
    order = np.concatenate([np.sort(np.asarray(m, dtype=np.int64)) for m in members])
    return order if imbalance(costs, order, bins) < imbalance(costs, in_order, bins) else in_order


def imbalance(costs: np.ndarray, order: np.ndarray, groups: int) -> float:
    """How much more the dearest of `groups` equal slices of `order` costs than their mean
    (0.05: the slowest does 5% more work than the average)."""
    loads = np.asarray(costs, dtype=np.float64)[order].reshape(groups, -1).sum(axis=1)
    return float(loads.max() / loads.mean() - 1.0) if loads.mean() > 0 else 0.0


def _longest_first(costs: np.ndarray, bins: int, size: int) -> list[list[int]]:
    members: list[list[int]] = [[] for _ in range(bins)]
    heap = [(0.0, b) for b in range(bins)]  # (load, bin) of the bins with room
    for row in np.argsort(-costs, kind="stable"):
        load, b = heapq.heappop(heap)
        members[b].append(int(row))
        if len(members[b]) < size:
            heapq.heappush(heap, (load + float(costs[row]), b))
    return members


def _swap_down(costs: np.ndarray, members: list[list[int]]) -> None:
    """Swap a row of the dearest bin with one of the cheapest where that brings the two
    closest together, until no swap narrows the gap."""
    for _ in range(SWAP_ROUNDS):
        loads = [float(costs[m].sum()) for m in members]
        high = int(np.argmax(loads))
        low = int(np.argmin(loads))
        gap = loads[high] - loads[low]
        if gap <= 0:
            return
        a = costs[members[high]][:, None]
        b = costs[members[low]][None, :]
        delta = a - b  # what a swap moves from high to low
        after = np.abs(gap - 2 * delta)
        after[(delta <= 0) | (delta >= gap)] = np.inf
        i, j = np.unravel_index(int(np.argmin(after)), after.shape)
        if not np.isfinite(after[i, j]) or after[i, j] >= gap:
            return
        members[high][i], members[low][j] = members[low][j], members[high][i]


__all__ = ["SequenceCost", "balanced_order", "imbalance"]
