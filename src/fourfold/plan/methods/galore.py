"""GaLore's planner model (train/methods/galore.py): per matrix its projection P (Q) and two
rank-r moments, R in place of the gradient, the projection's GEMMs and collectives, and a
refresh (a Gram matrix and its eigh) every `gap` steps."""

from __future__ import annotations

import dataclasses
from typing import cast

from fourfold.config import ModelConfig, TrainConfig
from fourfold.methods.galore import CHUNK_BYTES, GaLoreOptions, projection_rank
from fourfold.parallel.grid import GridShape
from fourfold.plan.memory import (Precision, axes_parts, largest_tensor_numel, local_matrices,
                                  local_vector_numel, matrix_layouts)
from fourfold.plan.methods.adamw import adamw_bytes_per_element
from fourfold.plan.methods.base import MethodCost, MethodModel, MethodState, on_axes
from fourfold.plan.perf import Rates, gemm_seconds
from fourfold.plan.schedule import Collective, local_param_numel

# The refresh's eigh of an s x s float64 Gram matrix: about 9 s^3 FLOPs, at this share of the
# float32 GEMM rate (a CPU's; bench/lean_step_time.py compares the step)
EIGH_FLOPS_PER_CUBE = 9.0
EIGH_RATE_OF_GEMM = 0.36


def options(train: TrainConfig) -> GaLoreOptions:
    return cast(GaLoreOptions, train.options())


def galore_update_bytes(model: ModelConfig, shape: GridShape, train: TrainConfig) -> int:
    """GaLore's largest transient after backward (every gradient and the moments still held),
    the largest over the matrices of:
    - a projection refresh (the first step and every gap-th), s = min(m, n): the s x s float64
      Gram while a chunk of the shard is gathered to its full small side (float32, CHUNK_BYTES
      at most, and its float64 copy), then eigh's input, output and workspace (syevd: about
      2 s^2), 4 s^2 float64 in all;
    - an update, a block of the other side at a time (w of its columns for P, rows for Q, the
      update back in the shard's basis CHUNK_BYTES at most): P (Q) gathered to its r columns
      where they are split, and per block R (r x w) before its reduce-scatter, this rank's
      share of it, Adam's step of the share (two temporaries) and the step gathered back, and
      the update back in the shard's basis.
    The refresh's is the larger but for tiny matrices; it does not shrink with the grid."""
    rank = options(train).rank
    worst = 0
    for m, n, rl, cl in local_matrices(model, shape):
        s, r = min(m, n), projection_rank((m, n), rank)
        width = min(max(1, CHUNK_BYTES // (4 * s)), cl if m < n else rl)
        refresh = max(8 * s * s + 12 * s * width, 32 * s * s)
        # P's side of the shard, the side the blocks cut; the axes' parts that split R's r
        # (the projected side's) and P's r (the other side's)
        side, other = (rl, cl) if m < n else (cl, rl)
        parts, others = (m // rl, n // cl) if m < n else (n // cl, m // rl)
        share = parts if r % parts == 0 else 1
        gathered = side * r if others > 1 and r % others == 0 else 0
        w = min(other, max(1, CHUNK_BYTES // (4 * side)))
        low = r * w
        worst = max(worst, refresh, 4 * (gathered + side * w + low + 2 * (low // share)))
    return worst


def galore_refresh_collectives(model: ModelConfig, shape: GridShape, train: TrainConfig
                               ) -> list[Collective]:
    """GaLore's collectives on a refresh step beyond its other steps', per rank
    (galore.small_side_gram and GaLore._projection): per matrix, its shard a chunk of the
    long side at a time (CHUNK_BYTES of the full small side s) all-gathered over the axes
    that split the small side, innermost first; the lower triangle of the s x s Gram (float64)
    all-reduced over each axis that splits the long side; and the new basis's r columns'
    signs, the dot products of this rank's block of them (float32), all-reduced over the axes
    that split the small side."""
    out: list[Collective] = []
    rank = options(train).rank
    for m, n, rows, cols in matrix_layouts(model):
        r, left = projection_rank((m, n), rank), m < n
        small, long_ = (m, n) if left else (n, m)
        small_axes, long_axes = (rows, cols) if left else (cols, rows)
        small_l = small // axes_parts(small_axes, shape)
        long_l = long_ // axes_parts(long_axes, shape)
        width = max(1, CHUNK_BYTES // (4 * small))
        cuts = [min(width, long_l - start) for start in range(0, long_l, width)]
        for w in sorted(set(cuts)):
            nbytes = small_l * w * 4
            for a in reversed(small_axes):
                nbytes *= getattr(shape, a)
                out += on_axes(shape, (a,), "all_gather", nbytes, cuts.count(w))
        if axes_parts(long_axes, shape) > 1:
            out += on_axes(shape, long_axes, "all_reduce", small * (small + 1) // 2 * 8)
        proj_parts = axes_parts(long_axes, shape)
        proj_r = r // proj_parts if r % proj_parts == 0 else r
        out += on_axes(shape, small_axes, "all_reduce", proj_r * 4)
    return out


class GaLoreModel(MethodModel):
    time_note = ("step time: forward + backward, galore's projections, and its refresh (Gram, "
                 "eigh and their collectives) spread over gap steps")

    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        """R, the projected gradient of every matrix (the moments' size), the vectors'
        gradients and the matrix being handed off (the largest block; with grad_accum > 1
        every gradient, until the last micro-step); per matrix its projection (local rows of
        the projected side x r, r split over the other side's axes where they divide it) and
        two r-rank moments (r split over the projected side's axes where they divide it);
        vectors plain AdamW."""
        numel = sum(local_param_numel(model, shape).values())
        vectors = local_vector_numel(model, shape)
        rank = options(train).rank
        state, projected = 2 * vectors, 0
        for m, n, rl, cl in local_matrices(model, shape):
            r = projection_rank((m, n), rank)
            # m < n: P (local rows x r), moments r x local cols; else Q and m_local x r
            # moments; the moments' r split as the projected side is, where that divides r
            parts = m // rl if m < n else n // cl
            rr = r // parts if r % parts == 0 else r
            # P's (Q's) r columns split as the other side is, where that divides r
            others = n // cl if m < n else m // rl
            pr = r // others if r % others == 0 else r
            state += rl * pr + 2 * rr * cl if m < n else cl * pr + 2 * rl * rr
            projected += rr * cl if m < n else rl * rr
        handed_off = largest_tensor_numel(model, shape)[1]
        grads = numel if train.grad_accum > 1 else projected + vectors + handed_off
        return MethodState(grads * precision.grad_bytes,
                           state * (precision.optimizer_bytes // 2))

    def update_bytes(self, model: ModelConfig, shape: GridShape, train: TrainConfig) -> int:
        return galore_update_bytes(model, shape, train)

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        """Per matrix the projection P^T G and the update P N(R) (two GEMMs of rank r over the
        local shard), Adam on R, the weights read and written, plain AdamW for vectors, and a
        refresh (Gram in float64 and its eigh) every gap steps, spread over them."""
        eb, adamw_bytes = precision.act_bytes, adamw_bytes_per_element(precision)
        rank, gap = options(train).rank, options(train).gap
        update_s, vectors = 0.0, sum(local_param_numel(model, shape).values())
        for m, n, rows, cols in matrix_layouts(model):
            r, s = projection_rank((m, n), rank), min(m, n)
            rl, cl = m // axes_parts(rows, shape), n // axes_parts(cols, shape)
            side, other = (rl, cl) if m < n else (cl, rl)
            vectors -= rl * cl
            gemms = 2 * gemm_seconds(r, other, side, rates, eb)  # project and update back
            # Adam on this rank's rows of R: r split over the axes that split the projected
            # side where they divide r (the reduce-scatter of `collectives`), else all r
            split = axes_parts(rows if m < n else cols, shape)
            adam_r = (r // split if r % split == 0 else r) * other * adamw_bytes
            weights = rl * cl * 2 * precision.param_bytes
            # the refresh, every gap steps: the Gram (float64: half the float32 rate) and its
            # eigh, the same s x s on every rank
            gram = 2 * gemm_seconds(s, s, other, rates, 8)
            eigh = EIGH_FLOPS_PER_CUBE * s ** 3 / (rates.flops * EIGH_RATE_OF_GEMM)
            update_s += gemms + (adam_r + weights) / rates.bytes_per_s + (gram + eigh) / gap
        return MethodCost(0, 1, update_s + vectors * adamw_bytes / rates.bytes_per_s)

    def collectives(self, model: ModelConfig, shape: GridShape, train: TrainConfig
                    ) -> list[Collective]:
        """Per matrix, P's r columns all-gathered (its local rows x r) over the axes that
        split the other side, once to project and once to update; per block of the other
        side (CHUNK_BYTES of G), R's r rows reduce-scattered over the axes that split the
        projected side (all-reduced over those that do not divide r), and Adam's step
        all-gathered back; and its refresh's, issued every gap steps
        (`galore_refresh_collectives`)."""
        out = [dataclasses.replace(c, every=options(train).gap)
               for c in galore_refresh_collectives(model, shape, train)]
        rank = options(train).rank
        for m, n, rows, cols in matrix_layouts(model):
            r, left = projection_rank((m, n), rank), m < n
            side_axes, other_axes = (rows, cols) if left else (cols, rows)
            side_l, other_l = (m, n) if left else (n, m)
            side_l //= axes_parts(side_axes, shape)
            other_l //= axes_parts(other_axes, shape)
            split = side_axes if r % axes_parts(side_axes, shape) == 0 else ()
            rest = tuple(a for a in side_axes if a not in split)
            proj_axes = other_axes if r % axes_parts(other_axes, shape) == 0 else ()
            # P (Q) with all r columns, gathered innermost axis first, to project and to update
            nbytes = side_l * r * 4 // axes_parts(proj_axes, shape)
            for a in reversed(proj_axes):
                nbytes *= getattr(shape, a)
                out += on_axes(shape, (a,), "all_gather", nbytes, 2)
            width = max(1, CHUNK_BYTES // (4 * side_l))
            cuts = [min(width, other_l - start) for start in range(0, other_l, width)]
            for w in sorted(set(cuts)):
                calls = cuts.count(w)
                nbytes = r * w * 4  # R's block, reduce-scattered outer axis first
                for a in split:
                    out += on_axes(shape, (a,), "reduce_scatter", nbytes, calls)
                    nbytes //= getattr(shape, a)
                out += on_axes(shape, rest, "all_reduce", nbytes, calls)
                for a in reversed(split):  # Adam's step of the block gathered back
                    nbytes *= getattr(shape, a)
                    out += on_axes(shape, (a,), "all_gather", nbytes, calls)
        return out


GALORE = GaLoreModel()
