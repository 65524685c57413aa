"""GaLore (Zhao et al. 2024): AdamW whose moments live in a rank-r projection of each matrix's
gradient; vectors (norms, biases) get plain AdamW.

For an m x n gradient G with m < n the projection is P = the top r left singular vectors of G
(m x r); the moments follow R = P^T G (r x n) and the step is P N(R), N being Adam's
normalised step. With m >= n it is the right side: Q = top r right singular vectors (n x r),
R = G Q (m x r), step N(R) Q^T. P (or Q) is recomputed from the step's gradient every
train.galore_gap steps; the moments carry over, as in the paper. The rank is train.galore_rank,
or a quarter of the smaller side (0), and never above the smaller side.

P (Q) is computed from the Gram matrix of the smaller side, s = min(m, n): the top r
eigenvectors of G G^T (G^T G), s x s, summed in float64 and solved with eigh (float64), the
same subspace as the SVD's without a copy of G: a refresh's transient is the Gram, eigh's
output and workspace (about 4 s^2 float64 in all), one chunk of G's columns (rows) gathered
to their full small side (GALORE_CHUNK_BYTES, float32) and its float64 copy, and the basis.
Eigenvalues that tie at the r-th leave the basis of their eigenspace to eigh (as to an SVD);
zero rows or columns (vocab padding) add nothing to the Gram.

On a grid this is the projection of the global gradient, so it trains as one process does
(up to the order of the Gram's float64 sums, which the float32 basis rarely sees). At a
refresh each matrix's shard is all-gathered a chunk at a time over the axes that split the
small side (a rank receives (p_small - 1) times its shard, and none of the long side), each
chunk's product is added to the s x s Gram, which is all-reduced over the axes that split the
long side (8 s^2 bytes); every rank then solves the same eigh and keeps only the rows of P
(or Q) that its shard needs. On one process the same chunks, without collectives.
Between refreshes a step reduce-scatters R's local part over the axes that split the
projected side (r rows of the shard's columns or rows: each rank keeps r / p of them, as an
all-reduce's first half would) and all-gathers Adam's step of them back (its second half);
where those axes do not divide r, R is all-reduced and its moments replicated over them. The
state per rank is its part of P (or Q) and of R's two moments, a quarter of them on 2 x 2
(parts of global tensors, which checkpoints save as such: a run resumes on any grid). A
refreshed singular vector takes the sign that agrees with the one it replaces (eigh's signs
are arbitrary, and a near-equal gradient on another grid could flip them; the first ones meet
zero moments, where sign is moot).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fourfold.config import TrainConfig
from fourfold.parallel import Layout
from fourfold.parallel.comm import Comm
from fourfold.parallel.grid import Axis
from fourfold.plan.memory import GALORE_CHUNK_BYTES, galore_rank
from fourfold.train.methods.adamw import backward_pass
from fourfold.train.methods.base import (Guard, ParamView, PerParameterState, StepData,
                                         StepResult, TrainingMethod, padded_dims, param_views,
                                         reduce_loss)

EPS = 1e-8


@torch.no_grad()
def small_side_gram(pieces: torch.Tensor, small_axes: tuple[Axis, ...],
                    long_axes: tuple[Axis, ...], comm: Comm,
                    chunk_bytes: int = GALORE_CHUNK_BYTES) -> torch.Tensor:
    """A A^T (s x s, float64, the same on every rank) of the global matrix A whose shard
    `pieces` is (its dim 0, the small side s, split over `small_axes`; dim 1, the long side,
    over `long_axes`). A few columns of the shard at a time are all-gathered over the small
    side's axes (float32, at most `chunk_bytes` gathered) and their product added; the lower
    triangle of the sums is then all-reduced over the long side's axes. With no axes (one
    process) the same chunks, without collectives."""
    s = pieces.shape[0] * math.prod(comm.grid.size(axis) for axis in small_axes)
    width = max(1, chunk_bytes // (4 * s))
    gram = torch.zeros(s, s, dtype=torch.float64, device=pieces.device)
    for start in range(0, pieces.shape[1], width):
        chunk = pieces[:, start:start + width].float().contiguous()
        for axis in reversed(small_axes):  # innermost first: rows in the offsets' order
            chunk = comm.all_gather(chunk, axis).wait()
        chunk = chunk.double()
        gram.addmm_(chunk, chunk.T)
        del chunk
    if any(comm.grid.size(axis) > 1 for axis in long_axes):
        # eigh reads the lower triangle only: half the bytes of the whole Gram
        rows, cols = torch.tril_indices(s, s, device=gram.device)
        lower = gram[rows, cols]
        for axis in long_axes:
            lower = comm.all_reduce(lower, axis).wait()
        gram[rows, cols] = lower
        del rows, cols, lower
        gram.tril_().add_(gram.tril(-1).T)  # symmetric again, as on one process
    return gram


def top_eigenvectors(gram: torch.Tensor, r: int) -> torch.Tensor:
    """The eigenvectors of the r largest eigenvalues of a symmetric matrix, largest first,
    float32 (s x r)."""
    _, vectors = torch.linalg.eigh(gram)  # ascending; reads the lower triangle
    return vectors[:, -r:].flip(1).float()


class GaLore(PerParameterState, TrainingMethod):
    name = "galore"
    update_time = "after_backward"

    def __init__(self, pmodel: Any, cfg: TrainConfig, tied_output: bool = False) -> None:
        self.views = param_views(pmodel, tied_output)
        self.grid, self.comm = pmodel.grid, pmodel.comm
        self.beta1, self.beta2 = cfg.beta1, cfg.beta2
        self.weight_decay, self.grad_clip = cfg.weight_decay, cfg.grad_clip
        self.rank, self.gap = cfg.galore_rank, cfg.galore_gap
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.steps_done = 0

    def _sum(self, t: torch.Tensor, axes: tuple) -> torch.Tensor:
        for axis in axes:
            if self.grid.size(axis) > 1:
                t = self.comm.all_reduce(t, axis).wait()
        return t

    def field_layout(self, view: ParamView, field: str) -> Layout | None:
        if view.param.dim() != 2:
            return view.layout if field in ("m", "v") else None
        # P (left, m < n) holds the shard's rows, R = P^T G its columns (replicated over the
        # row axes it was summed over); Q and R = G Q the other way round
        m, n = view.full_shape
        rows, cols = padded_dims(view)
        if field == "proj":
            return Layout((rows if m < n else cols, ()))
        if field in ("m", "v"):
            split = self._rank_axes(view, galore_rank(view.full_shape, self.rank))
            return Layout((split, cols)) if m < n else Layout((rows, split))
        return None

    def _rank_axes(self, view: ParamView, r: int) -> tuple[Axis, ...]:
        """The axes that split R's rank dim (and its moments'): those R is summed over (the
        ones that split the projected side) where they divide r, else none (R replicated)."""
        m, n = view.full_shape
        axes = padded_dims(view)[0 if m < n else 1]
        return axes if r % math.prod(self.grid.size(a) for a in axes) == 0 else ()

    def _scatter(self, t: torch.Tensor, axes: tuple[Axis, ...]) -> torch.Tensor:
        for axis in axes:  # outer first: this rank's block of dim 0, in the offsets' order
            t = self.comm.reduce_scatter(t, axis).wait()
        return t

    def _gather(self, t: torch.Tensor, axes: tuple[Axis, ...]) -> torch.Tensor:
        for axis in reversed(axes):  # innermost first
            t = self.comm.all_gather(t.contiguous(), axis).wait()
        return t

    @torch.no_grad()
    def _projection(self, view: ParamView, grad: torch.Tensor, left: bool, r: int,
                    previous: torch.Tensor | None) -> torch.Tensor:
        """This shard's rows of P (left) or Q (right): the top eigenvectors of the global
        gradient's small-side Gram matrix."""
        dim = 0 if left else 1
        split = padded_dims(view)
        # the small side first: G's shard for P (G G^T), its transpose for Q (G^T G)
        gram = small_side_gram(grad if left else grad.T, split[dim], split[1 - dim], self.comm)
        basis = top_eigenvectors(gram, r)  # (m, r) or (n, r)
        del gram
        start, size = view.offsets[dim], view.param.shape[dim]
        basis = basis[start:start + size].contiguous()
        if previous is not None:
            # the moments were kept in the old basis: each new direction takes the sign that
            # agrees with the old one (dot products over the full vectors: summed over the
            # axes that split this side). Before the first step's moments the sign is moot.
            dots = self._sum((basis * previous).sum(0), split[dim])
            basis = basis * torch.where(dots < 0, -1.0, 1.0)
        return basis

    @torch.no_grad()
    def _update(self, view: ParamView, lr: float, t: int, refresh: bool) -> None:
        p, g = view.param, view.param.grad.float()
        state = self.state.setdefault(view.name, {})
        if p.dim() == 2:
            m, n = view.full_shape
            left = m < n
            r = galore_rank(view.full_shape, self.rank)
            row_axes, col_axes = view.layout.dims + ((),) * (2 - len(view.layout.dims))
            if refresh or "proj" not in state:
                state["proj"] = self._projection(view, g, left, r, state.get("proj"))
            proj = state["proj"]
            # R, rank dim first: P^T G (r, n_local) summed over the axes that split G's rows,
            # or (G Q)^T = Q^T G^T (r, m_local) over those that split its columns; reduce-scattered
            # over them (this rank keeps its r / p rows), all-reduced where they do not divide r
            split = self._rank_axes(view, r)
            summed = row_axes if left else col_axes
            low = proj.T @ (g if left else g.T)
            low = self._sum(self._scatter(low, split), tuple(a for a in summed if a not in split))
            if not left:
                low = low.T  # (m_local, r / p): the moments' layout
        else:
            low = g
        if "m" not in state:
            state["m"] = torch.zeros(low.shape, dtype=low.dtype, device=low.device)
            state["v"] = torch.zeros_like(state["m"])
        state["m"].mul_(self.beta1).add_(low, alpha=1.0 - self.beta1)
        state["v"].mul_(self.beta2).addcmul_(low, low, value=1.0 - self.beta2)
        step = (state["m"] / (1.0 - self.beta1 ** t)).div_(
            (state["v"] / (1.0 - self.beta2 ** t)).sqrt_().add_(EPS))
        if view.decay and self.weight_decay:
            p.mul_(1.0 - lr * self.weight_decay)
        if p.dim() == 2:  # Adam's step of every rank's rows of R, back in the shard's basis
            step = self._gather(step if left else step.T, split)
            # P (rows, r) @ step (r, cols), or step^T (rows, r) @ Q^T (r, cols), made and added
            # a row block at a time: no temporary as large as the shard (which also leaves no
            # shard-sized hole in the heap for the next, slightly larger one to miss)
            lhs, rhs = (state["proj"], step) if left else (step.T, state["proj"].T)
            rows = max(1, GALORE_CHUNK_BYTES // (4 * p.shape[1]))
            for a in range(0, p.shape[0], rows):
                p[a:a + rows].add_((lhs[a:a + rows] @ rhs).to(p.dtype), alpha=-lr)
        else:
            p.add_(step.to(p.dtype), alpha=-lr)

    def step(self, pmodel: Any, data: StepData, lr: float, guard: Guard | None = None
             ) -> StepResult:
        for v in self.views:
            v.param.grad = None
        loss = reduce_loss(pmodel, backward_pass(pmodel, data))
        self.note_gradients(pmodel)
        norm = float(pmodel.clip_grad_norm_(self.grad_clip if self.grad_clip > 0 else math.inf))
        reason = guard(loss, norm) if guard is not None else None
        if reason is None:
            t, refresh = self.steps_done + 1, self.steps_done % self.gap == 0
            for v in self.views:
                if v.param.grad is not None:
                    self._update(v, lr, t, refresh)
                    # its gradient goes now: the next matrix's temporaries reuse its block
                    v.param.grad = None
            self.steps_done += 1
        for v in self.views:
            v.param.grad = None
        return StepResult(loss, norm, reason is not None, reason or "")
