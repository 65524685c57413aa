"""GaLore's planner model (train/methods/galore.py): per target matrix its projection P (Q, or
both) and two rank-r moments, R in place of the gradient, the projection's GEMMs and
collectives, and a refresh (a Gram matrix and its eigh) every `gap` steps; the other matrices
and the vectors plain AdamW."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, cast

from fourfold.config import ModelConfig, TrainConfig
from fourfold.methods.galore import (CHUNK_BYTES, TARGET_LEAVES, GaLoreOptions,
                                     projected_sides, projection_rank)
from fourfold.parallel.grid import GridShape
from fourfold.plan.memory import Precision, axes_parts
from fourfold.plan.methods.adamw import adamw_bytes_per_element
from fourfold.plan.methods.base import MethodCost, MethodModel, MethodState, on_axes
from fourfold.plan.perf import Rates, gemm_seconds
from fourfold.plan.schedule import Collective, block_linears, local_param_numel

# The refresh's eigh of an s x s float64 Gram matrix: about 9 s^3 FLOPs, at this share of the
# float32 GEMM rate (a CPU's; bench/lean_step_time.py compares the step)
EIGH_FLOPS_PER_CUBE = 9.0
EIGH_RATE_OF_GEMM = 0.36


class Projected(NamedTuple):
    """A target matrix as GaLore projects it: full rows and columns, the axes that split
    them, the sides projected and the rank."""

    m: int
    n: int
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    sides: tuple[str, ...]
    r: int

    def local(self, shape: GridShape) -> tuple[int, int]:
        return self.m // axes_parts(self.rows, shape), self.n // axes_parts(self.cols, shape)

    @property
    def left(self) -> bool:
        return self.sides == ("left",)


def options(train: TrainConfig) -> GaLoreOptions:
    return cast(GaLoreOptions, train.options())


def projected_matrices(model: ModelConfig, train: TrainConfig) -> list[Projected]:
    """The matrices train.method.targets projects, as the engine lays them out
    (plan/memory.py matrix_layouts: W[out, in] with out split over (y, z) and in over x, a
    transposed layer the other way; the embedding and output layer as a normal layer)."""
    opts = options(train)
    found = []
    for lin in block_linears(model):
        if lin.name in opts.targets:
            rows, cols = (("x", "z"), ("y",)) if lin.transposed else (("y", "z"), ("x",))
            found += [(lin.out_features, lin.in_features, rows, cols)] * model.n_layers
    ends = ["embed"] + ([] if model.tie_embeddings else ["output"])
    found += [(model.vocab_size, model.dim, ("y", "z"), ("x",)) for t in ends
              if t in opts.targets and t in TARGET_LEAVES]
    return [Projected(m, n, rows, cols, projected_sides((m, n), opts.proj_type),
                      projection_rank((m, n), opts.rank)) for m, n, rows, cols in found]


def _dividing(r: int, parts: int) -> int:
    """The parts `parts` ranks split r into: all of them where they divide it, else none."""
    return parts if r % parts == 0 else 1


def galore_update_bytes(model: ModelConfig, shape: GridShape, train: TrainConfig) -> int:
    """GaLore's largest transient after backward (every gradient and the moments still held),
    the largest over the target matrices of:
    - a projection refresh (the first step and every gap-th), s = min(m, n): the s x s float64
      Gram while a chunk of the shard is gathered to its full small side (float32, CHUNK_BYTES
      at most, and its float64 copy), then eigh's input, output and workspace (syevd: about
      2 s^2), 4 s^2 float64 in all; a larger side's basis adds its shard's rows x r twice in
      float64;
    - an update, a block of the other side at a time (w of its columns for P, rows for Q, the
      update back in the shard's basis CHUNK_BYTES at most): P (Q) gathered to its r columns
      where they are split, and per block R (r x w) before its reduce-scatter, this rank's
      share of it, Adam's step of the share (two temporaries) and the step gathered back, and
      the update back in the shard's basis. Both sides: P N(R) (rows x r) and a block.
    The refresh's is the larger but for tiny matrices; it does not shrink with the grid."""
    worst = 0
    for mat in projected_matrices(model, train):
        (m, n), r = (mat.m, mat.n), mat.r
        rl, cl = mat.local(shape)
        s = min(m, n)
        small = 0 if m < n else 1
        width = min(max(1, CHUNK_BYTES // (4 * s)), cl if small == 0 else rl)
        refresh = max(8 * s * s + 12 * s * width, 32 * s * s)
        for side in mat.sides:
            if (0 if side == "left" else 1) != small:
                refresh += 2 * 8 * (rl if small == 1 else cl) * r
        if len(mat.sides) == 2:
            update = 4 * (rl * r + rl * min(cl, max(1, CHUNK_BYTES // (4 * rl))) + 3 * r * r)
        else:
            # P's side of the shard, the side the blocks cut; the axes' parts that split R's
            # r (the projected side's) and P's r (the other side's)
            side, other = (rl, cl) if mat.left else (cl, rl)
            parts, others = (m // rl, n // cl) if mat.left else (n // cl, m // rl)
            share = parts if r % parts == 0 else 1
            gathered = side * r if others > 1 and r % others == 0 else 0
            w = min(other, max(1, CHUNK_BYTES // (4 * side)))
            low = r * w
            update = 4 * (gathered + side * w + low + 2 * (low // share))
        worst = max(worst, refresh, update)
    return worst


def galore_refresh_collectives(model: ModelConfig, shape: GridShape, train: TrainConfig
                               ) -> list[Collective]:
    """GaLore's collectives on a refresh step beyond its other steps', per rank
    (galore.small_side_gram and GaLore._projection): per target matrix, its shard a chunk of
    the long side at a time (CHUNK_BYTES of the full small side s) all-gathered over the axes
    that split the small side, innermost first; the lower triangle of the s x s Gram (float64)
    all-reduced over each axis that splits the long side; a larger side's basis, its shard's
    rows x r (float64), all-reduced over the axes that split the small side; and each new
    basis's r columns' signs, the dot products of this rank's block of them (float32),
    all-reduced over the axes that split its side."""
    out: list[Collective] = []
    for mat in projected_matrices(model, train):
        m, n, r = mat.m, mat.n, mat.r
        small_dim = 0 if m < n else 1
        small, long_ = (m, n) if small_dim == 0 else (n, m)
        small_axes, long_axes = (mat.rows, mat.cols) if small_dim == 0 else (mat.cols, mat.rows)
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
        for side in mat.sides:
            dim = 0 if side == "left" else 1
            side_axes, other_axes = (mat.rows, mat.cols) if dim == 0 else (mat.cols, mat.rows)
            if dim != small_dim:
                out += on_axes(shape, small_axes, "all_reduce", long_l * r * 8)
            proj_r = r if len(mat.sides) == 2 else r // _dividing(r, axes_parts(other_axes,
                                                                               shape))
            out += on_axes(shape, side_axes, "all_reduce", proj_r * 4)
    return out


class GaLoreModel(MethodModel):
    time_note = ("step time: forward + backward, galore's projections, and its refresh (Gram, "
                 "eigh and their collectives) spread over gap steps")

    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        """R, the projected gradient of every target matrix (the moments' size), the other
        parameters' gradients and the matrix being handed off (the largest block; with
        grad_accum > 1 every gradient, until the last micro-step); per target matrix its
        projection (local rows of the projected side x r, r split over the other side's axes
        where they divide it) and two r-rank moments (r split over the projected side's axes
        where they divide it), or with both sides P, Q and two r x r moments; the rest
        plain AdamW."""
        numel = sum(local_param_numel(model, shape).values())
        unprojected, state, projected = numel, 0, 0
        for mat in projected_matrices(model, train):
            rl, cl = mat.local(shape)
            r, unprojected = mat.r, unprojected - rl * cl
            if len(mat.sides) == 2:
                state += (rl + cl) * r + 2 * r * r
                projected += r * r
                continue
            # left: P (local rows x r), moments r x local cols; else Q and m_local x r
            # moments; the moments' r split as the projected side is, where that divides r
            parts = mat.m // rl if mat.left else mat.n // cl
            rr = r // _dividing(r, parts)
            # P's (Q's) r columns split as the other side is, where that divides r
            pr = r // _dividing(r, mat.n // cl if mat.left else mat.m // rl)
            state += rl * pr + 2 * rr * cl if mat.left else cl * pr + 2 * rl * rr
            projected += rr * cl if mat.left else rl * rr
        # the largest target matrix's gradient, alive until its hand-off
        handed_off = max((rl * cl for rl, cl in (mat.local(shape) for mat in
                                                 projected_matrices(model, train))), default=0)
        # an untied embedding's gradient comes last in backward, after every target's
        # hand-off: where it is not a target, the largest hand-off overlaps only the rest
        embed = 0 if "embed" in options(train).targets or model.tie_embeddings else (
            model.vocab_size * model.dim // (shape.x * shape.y * shape.z))
        grads = numel if train.grad_accum > 1 else (
            projected + unprojected + max(0, handed_off - embed))
        return MethodState(grads * precision.grad_bytes,
                           (state + 2 * unprojected) * (precision.optimizer_bytes // 2))

    def update_bytes(self, model: ModelConfig, shape: GridShape, train: TrainConfig) -> int:
        return galore_update_bytes(model, shape, train)

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        """Per target matrix the projection P^T G and the update P N(R) (two GEMMs of rank r
        over the local shard; four with both sides), Adam on R, the weights read and
        written, plain AdamW for the rest, and a refresh (Gram in float64 and its eigh)
        every gap steps, spread over them."""
        eb, adamw_bytes = precision.act_bytes, adamw_bytes_per_element(precision)
        gap = options(train).gap
        update_s, unprojected = 0.0, sum(local_param_numel(model, shape).values())
        for mat in projected_matrices(model, train):
            r, s = mat.r, min(mat.m, mat.n)
            rl, cl = mat.local(shape)
            side, other = (rl, cl) if mat.left else (cl, rl)
            unprojected -= rl * cl
            gemms = 2 * len(mat.sides) * gemm_seconds(r, other, side, rates, eb)
            # Adam on this rank's rows of R: r split over the axes that split the projected
            # side where they divide r (the reduce-scatter of `collectives`), else all r
            split = axes_parts(mat.rows if mat.left else mat.cols, shape)
            adam_r = (r * r if len(mat.sides) == 2 else r // _dividing(r, split) * other) \
                * adamw_bytes
            weights = rl * cl * 2 * precision.param_bytes
            # the refresh, every gap steps: the Gram (float64: half the float32 rate) and its
            # eigh, the same s x s on every rank
            gram = 2 * gemm_seconds(s, s, cl if mat.m < mat.n else rl, rates, 8)
            eigh = EIGH_FLOPS_PER_CUBE * s ** 3 / (rates.flops * EIGH_RATE_OF_GEMM)
            update_s += gemms + (adam_r + weights) / rates.bytes_per_s + (gram + eigh) / gap
        return MethodCost(0, 1, update_s + unprojected * adamw_bytes / rates.bytes_per_s)

    def collectives(self, model: ModelConfig, shape: GridShape, train: TrainConfig
                    ) -> list[Collective]:
        """Per target matrix, P's r columns all-gathered (its local rows x r) over the axes
        that split the other side, once to project and once to update; per block of the
        other side (CHUNK_BYTES of G), R's r rows reduce-scattered over the axes that split
        the projected side (all-reduced over those that do not divide r), and Adam's step
        all-gathered back; with both sides R (r x r) all-reduced over every axis that splits
        G; and its refresh's, issued every gap steps (`galore_refresh_collectives`)."""
        out = [dataclasses.replace(c, every=options(train).gap)
               for c in galore_refresh_collectives(model, shape, train)]
        for mat in projected_matrices(model, train):
            r = mat.r
            if len(mat.sides) == 2:
                out += on_axes(shape, mat.rows + mat.cols, "all_reduce", r * r * 4)
                continue
            side_axes, other_axes = (mat.rows, mat.cols) if mat.left else (mat.cols, mat.rows)
            side_l, other_l = (mat.m, mat.n) if mat.left else (mat.n, mat.m)
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
