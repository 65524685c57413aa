"""GaLore (Zhao et al. 2024): AdamW whose moments live in a rank-r projection of each matrix's
gradient; vectors (norms, biases) get plain AdamW.

For an m x n gradient G with m < n the projection is P = the top r left singular vectors of G
(m x r); the moments follow R = P^T G (r x n) and the step is P N(R), N being Adam's
normalised step. With m >= n it is the right side: Q = top r right singular vectors (n x r),
R = G Q (m x r), step N(R) Q^T. P (or Q) is recomputed from the step's gradient every
train.method.gap steps; the moments carry over, as in the paper. The rank is train.method.rank,
or a quarter of the smaller side (0), and never above the smaller side.

A matrix's full gradient lives only until it is final (LOMO's hand-off, base.on_final_gradients:
after its z reduce-scatter and data all-reduce): there it adds its squared norm to the step's,
refreshes P (Q) when the step is a refresh step, is projected to R, and is freed. So what a
step holds until its update is R, r/s of the gradient, not G; clipping by the global norm
scales R, which is linear in G (the same update as clipping G first). Adam and the step back
to the weights run after backward, when the norm is known and a guard can still skip the step
(under nan_policy "skip" a refreshed basis waits beside the old one until then; a gradient that
is not finite refreshes nothing). With grad_accum > 1 the gradients accumulate whole until the
last micro-step's hand-off.

P (Q) is computed from the Gram matrix of the smaller side, s = min(m, n): the top r
eigenvectors of G G^T (G^T G), s x s, summed in float64 and solved with eigh (float64), the
same subspace as the SVD's without a copy of G: a refresh's transient is the Gram, eigh's
output and workspace (about 4 s^2 float64 in all), one chunk of G's columns (rows) gathered
to their full small side (CHUNK_BYTES, float32) and its float64 copy, and the basis.
It runs inside backward, when the later layers' gradients are already projected and freed,
after the method's before_transient hook (PhaseHooks: on a host, the memory policy hands the
heap's free pages back there, so that they are not resident beside it).
Eigenvalues that tie at the r-th leave the basis of their eigenspace to eigh (as to an SVD);
zero rows or columns (vocab padding) add nothing to the Gram.

On a grid this is the projection of the global gradient, so it trains as one process does
(up to the order of the Gram's float64 sums, which the float32 basis rarely sees). At a
refresh each matrix's shard is all-gathered a chunk at a time over the axes that split the
small side (a rank receives (p_small - 1) times its shard, and none of the long side), each
chunk's product is added to the s x s Gram, which is all-reduced over the axes that split the
long side (8 s^2 bytes); every rank then solves the same eigh and keeps only the rows of P
(or Q) that its shard needs, and its block of their r columns (below). On one process the same
chunks, without collectives.
R is made a block of G's other side at a time (w of its columns for P, of its rows for Q: R's,
the moments' and the update's entries there depend on those alone, so no temporary outgrows a
block): per block its local part is reduce-scattered over the axes that split the projected
side (r rows of the block: each rank keeps r / p of them, as an all-reduce's first half
would); after backward Adam's step of this rank's rows is all-gathered back (its second half)
a block at a time. Where those axes do not divide r, R is all-reduced and its moments
replicated over them. P's (Q's) r columns are split over the axes that split the other side,
where they divide r (every rank along them needs the same rows of P): the projection and the
update each all-gather them (local rows x r, float32) once per matrix. So the state and R per
rank are a quarter of P (or Q), of R and of its two moments on 2 x 2 (parts of global tensors,
which checkpoints save as such: a run resumes on any grid). A refreshed singular vector takes
the sign that agrees with the one it replaces (eigh's signs are arbitrary, and a near-equal
gradient on another grid could flip them; the first ones meet zero moments, where sign is
moot).
"""

from __future__ import annotations

import math

import torch

from fourfold.config import TrainConfig
from fourfold.methods.galore import CHUNK_BYTES, GaLoreOptions, projection_rank
from fourfold.parallel import Layout, ParallelModel
from fourfold.parallel.comm import Comm
from fourfold.parallel.grid import Axis
from fourfold.train.methods.base import (ParamView, PerParameterState, PhaseHooks, StepData,
                                         StepGuard, StepResult, TrainingMethod,
                                         arm_on_last_micro_step, backward_pass, on_final_gradients,
                                         padded_dims, param_views, reduce_loss, shard_norm_sq)

EPS = 1e-8


@torch.no_grad()
def small_side_gram(pieces: torch.Tensor, small_axes: tuple[Axis, ...],
                    long_axes: tuple[Axis, ...], comm: Comm,
                    chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
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

    def __init__(self, pmodel: ParallelModel, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> None:
        options = cfg.options()
        assert isinstance(options, GaLoreOptions)
        self.views = param_views(pmodel, tied_output)
        self._view = {id(v.param): v for v in self.views}
        self.grid, self.comm = pmodel.grid, pmodel.comm
        self.beta1, self.beta2 = cfg.beta1, cfg.beta2
        self.weight_decay, self.grad_clip = cfg.effective_weight_decay(), cfg.grad_clip
        self.rank, self.gap = options.rank, options.gap
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.steps_done = 0
        # the state is made up front, before any gradient: on a host it then lies below them
        # in the heap, and the blocks every step's gradients and temporaries free are reused
        # by the next step's (made at the first update, between the freed gradients, it would
        # leave holes the later, differently sized tensors could not fill)
        for v in self.views:
            if v.param.requires_grad:
                self.state[v.name] = self._new_state(v)
        # a step's hand-offs: each matrix's share of R, its refreshed basis (when it waits for
        # the update) and the squared norm of the gradients they came from
        self._low: dict[str, torch.Tensor] = {}
        self._new_proj: dict[str, torch.Tensor] = {}
        self._norm_sq = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        self.hooks = hooks or PhaseHooks()
        self._armed = False  # on the last micro-step of a backward
        self._refresh = False
        # a refreshed basis replaces the old one at once, unless a step the guard rejects can
        # be skipped and the run go on (nan_policy "skip"): then the old basis stays until the
        # update (its copy costs one more P per matrix at a refresh); "stop" ends the run and
        # "rollback" reloads the state
        self._keep_old_basis = cfg.nan_policy == "skip"
        self._release = on_final_gradients(pmodel, self.views, self._on_grad_ready)

    def _new_state(self, view: ParamView) -> dict[str, torch.Tensor]:
        """Zero moments (and a zero projection, which the first step's refresh replaces)."""
        p = view.param
        zeros = dict(dtype=torch.float32, device=p.device)
        if p.dim() != 2:
            return {"m": torch.zeros(p.shape, **zeros), "v": torch.zeros(p.shape, **zeros)}
        m, n = view.full_shape
        r = projection_rank(view.full_shape, self.rank)
        rr = r // math.prod(self.grid.size(a) for a in self._rank_axes(view, r))
        pr = r // math.prod(self.grid.size(a) for a in self._proj_axes(view, r))
        moments = (rr, p.shape[1]) if m < n else (p.shape[0], rr)
        return {"proj": torch.zeros(p.shape[0 if m < n else 1], pr, **zeros),
                "m": torch.zeros(moments, **zeros), "v": torch.zeros(moments, **zeros)}

    def _sum(self, t: torch.Tensor, axes: tuple) -> torch.Tensor:
        for axis in axes:
            if self.grid.size(axis) > 1:
                t = self.comm.all_reduce(t, axis).wait()
        return t

    def field_layout(self, view: ParamView, field: str) -> Layout | None:
        if view.param.dim() != 2:
            return view.layout if field in ("m", "v") else None
        # P (left, m < n): the shard's rows, its r columns split over the axes that split G's
        # columns; R = P^T G (r x the shard's columns), r split over the row axes it is summed
        # over. Q and R = G Q the other way round.
        m, n = view.full_shape
        rows, cols = padded_dims(view)
        r = projection_rank(view.full_shape, self.rank)
        if field == "proj":
            return Layout((rows, self._proj_axes(view, r)) if m < n
                          else (cols, self._proj_axes(view, r)))
        if field in ("m", "v"):
            split = self._rank_axes(view, r)
            return Layout((split, cols)) if m < n else Layout((rows, split))
        return None

    def _dividing(self, axes: tuple[Axis, ...], r: int) -> tuple[Axis, ...]:
        return axes if r % math.prod(self.grid.size(a) for a in axes) == 0 else ()

    def _rank_axes(self, view: ParamView, r: int) -> tuple[Axis, ...]:
        """The axes that split R's rank dim (and its moments'): those R is summed over (the
        ones that split the projected side) where they divide r, else none (R replicated)."""
        m, n = view.full_shape
        return self._dividing(padded_dims(view)[0 if m < n else 1], r)

    def _proj_axes(self, view: ParamView, r: int) -> tuple[Axis, ...]:
        """The axes that split P's (Q's) r columns: those that split the other side of the
        matrix (every rank along them holds the same rows of P) where they divide r, else
        none (P replicated over them). A step all-gathers the r columns (side_local x r)."""
        m, n = view.full_shape
        return self._dividing(padded_dims(view)[1 if m < n else 0], r)

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
                    previous: torch.Tensor | None) -> torch.Tensor | None:
        """This shard's rows of P (left) or Q (right), this rank's block of their r columns:
        the top eigenvectors of the global gradient's small-side Gram matrix; None for a
        gradient that is not finite (the same on every rank: the Gram is)."""
        dim = 0 if left else 1
        split = padded_dims(view)
        # the refresh's transient: Gram, chunks, eigh's workspace (~4 s^2 float64)
        self.hooks.before_transient()
        # the small side first: G's shard for P (G G^T), its transpose for Q (G^T G)
        gram = small_side_gram(grad if left else grad.T, split[dim], split[1 - dim], self.comm)
        if not bool(torch.isfinite(gram).all()):  # eigh would fail; the guard skips the step
            return None
        basis = top_eigenvectors(gram, r)  # (m, r) or (n, r)
        del gram
        # this rank's rows and block of the r columns, as the field's layout places them
        basis = self.field_layout(view, "proj").shard(
            basis, self.grid.shape, self.grid.shape.coords(self.grid.rank))
        if previous is not None:
            # the moments were kept in the old basis: each new direction takes the sign that
            # agrees with the old one (dot products over the full vectors: summed over the
            # axes that split this side). Before the first step's moments the sign is moot.
            dots = self._sum((basis * previous).sum(0), split[dim])
            basis = basis * torch.where(dots < 0, -1.0, 1.0)
        return basis

    # ---- the hand-off: inside backward -------------------------------------------------

    @torch.no_grad()
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        view = self._view.get(id(p))
        if not self._armed or view is None or p.grad is None or p.dim() != 2:
            return  # a vector's gradient (small) waits for the update
        g = p.grad.float()
        self._norm_sq += shard_norm_sq(view, g, self.grid.shape)
        m, n = view.full_shape
        left, r = m < n, projection_rank(view.full_shape, self.rank)
        state = self.state.setdefault(view.name, {})
        if "m" not in state:  # a checkpoint from before the first step had none
            state.update(self._new_state(view))
        basis = state["proj"]
        new = self._projection(view, g, left, r, basis) if self._refresh else None
        if new is not None and self._keep_old_basis:  # until the update commits it
            basis = self._new_proj[view.name] = new
        elif new is not None:
            basis.copy_(new)
            del new
        self._low[view.name] = self._project(view, g, basis, left, r)
        # the most alive at once: this gradient and its R, beside the R's before them
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._live_grad_bytes())
        del g
        self._release(p)

    def _live_grad_bytes(self) -> int:
        """Full gradients alive (matrices before their hand-off, vectors) and R's so far."""
        return sum(t.numel() * t.element_size() for t in
                   [v.param.grad for v in self.views if v.param.grad is not None]
                   + list(self._low.values()))

    def _blocks(self, view: ParamView, left: bool) -> list[slice]:
        """The blocks of G's other side (its columns for P, its rows for Q) a step works on
        one at a time: CHUNK_BYTES of G (and of the update) each."""
        p = view.param
        other = p.shape[1] if left else p.shape[0]
        width = max(1, CHUNK_BYTES // (4 * p.shape[0 if left else 1]))
        return [slice(a, min(a + width, other)) for a in range(0, other, width)]

    def _project(self, view: ParamView, g: torch.Tensor, basis: torch.Tensor, left: bool,
                 r: int) -> torch.Tensor:
        """This rank's share of R, shaped as the moments: P^T G (r, n_local) summed over the
        axes that split G's rows, or (G Q)^T = Q^T G^T (r, m_local) over those that split its
        columns, reduce-scattered over them (this rank keeps its r / p rows; all-reduced
        where they do not divide r); a block of G's other side at a time."""
        row_axes, col_axes = padded_dims(view)
        split = self._rank_axes(view, r)
        rest = tuple(a for a in (row_axes if left else col_axes) if a not in split)
        # P (Q) with all r columns, (side_local, r): gathered over the axes that split them
        proj = self._gather(basis.T, self._proj_axes(view, r)).T
        out = torch.empty_like(self.state[view.name]["m"])
        for cut in self._blocks(view, left):
            low = proj.T @ (g[:, cut] if left else g[cut].T)  # (r, block)
            low = self._sum(self._scatter(low, split), rest)  # (r / p, block)
            if left:
                out[:, cut] = low
            else:
                out[cut] = low.T
            del low
        return out

    # ---- the update: after backward -----------------------------------------------------

    @torch.no_grad()
    def _update(self, view: ParamView, lr: float, t: int, coef: float) -> None:
        p, state = view.param, self.state[view.name]
        if view.decay and self.weight_decay:
            p.mul_(1.0 - lr * self.weight_decay)
        if p.dim() != 2:  # plain AdamW
            g = p.grad.float()
            if coef != 1.0:
                g = g * coef
            p.add_(self._adam(state["m"], state["v"], g, t).to(p.dtype), alpha=-lr)
            return
        m, n = view.full_shape
        left, r = m < n, projection_rank(view.full_shape, self.rank)
        if view.name in self._new_proj:  # a refresh: the new basis replaces the old
            state["proj"].copy_(self._new_proj.pop(view.name))
        low = self._low.pop(view.name)
        if coef != 1.0:
            low.mul_(coef)
        proj = self._gather(state["proj"].T, self._proj_axes(view, r)).T
        split = self._rank_axes(view, r)
        for cut in self._blocks(view, left):
            # the moments' and R's entries of this block, (r / p, block) views
            if left:
                mom_m, mom_v, grad = state["m"][:, cut], state["v"][:, cut], low[:, cut]
            else:
                mom_m, mom_v, grad = state["m"][cut].T, state["v"][cut].T, low[cut].T
            step = self._adam(mom_m, mom_v, grad, t)
            step = self._gather(step, split)  # (r, block): every rank's rows of Adam's step
            # P (rows, r) @ step (r, block), or step^T (block, r) @ Q^T (r, cols), added
            # to the weights' block by the GEMM itself (no block-sized product in between)
            a, b = (proj, step) if left else (step.T, proj.T)
            block = p[:, cut] if left else p[cut]
            if p.dtype == step.dtype:
                block.addmm_(a, b, alpha=-lr)
            else:
                block.add_((a @ b).to(p.dtype), alpha=-lr)
            del step
        del low

    def _adam(self, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, t: int
              ) -> torch.Tensor:
        """Adam's moments of `grad` updated in place (m, v may be views), and its normalised
        step (bias-corrected, step t)."""
        m.mul_(self.beta1).add_(grad, alpha=1.0 - self.beta1)
        v.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
        return (m / (1.0 - self.beta1 ** t)).div_(
            (v / (1.0 - self.beta2 ** t)).sqrt_().add_(EPS))

    def _clip_coef(self) -> tuple[float, float]:
        """The global gradient norm (matrices' at their hand-off, vectors' now: each element
        counted once over the grid) and the factor that clips it to train.grad_clip."""
        total = self._norm_sq.clone()
        for v in self.views:
            if v.param.grad is not None and v.param.dim() != 2:
                total += shard_norm_sq(v, v.param.grad, self.grid.shape)
        if self.grid.world_size > 1:  # data replicas hold the same gradients
            total = self.comm.all_reduce(total, "tensor").wait()
        norm = float(total.sqrt())
        coef = 1.0
        if self.grad_clip > 0 and math.isfinite(norm):
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
        return norm, coef

    def step(self, pmodel: ParallelModel, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        for v in self.views:
            v.param.grad = None
        self._refresh = self.steps_done % self.gap == 0
        self.hooks.step_start()
        self._norm_sq.zero_()
        try:
            loss = reduce_loss(pmodel, backward_pass(pmodel, arm_on_last_micro_step(
                data, lambda on: setattr(self, "_armed", on)), self.hooks.after_forward))
        finally:
            self._armed = False
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._live_grad_bytes())
        norm, coef = self._clip_coef()
        reason = guard.check(loss, norm) if guard is not None else None
        if reason is None:
            t = self.steps_done + 1
            self.hooks.before_update()
            for v in self.views:
                if v.name in self._low or (v.param.dim() != 2 and v.param.grad is not None):
                    self._update(v, lr, t, coef)
                    # its gradient goes now: the next tensor's temporaries reuse its block
                    v.param.grad = None
            self.steps_done += 1
        self._low.clear()
        self._new_proj.clear()
        for v in self.views:
            v.param.grad = None
        return StepResult(loss, norm, reason is not None, reason or "")
