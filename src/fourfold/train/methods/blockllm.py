"""BlockLLM (Ramesh et al. 2024): AdamW on a selected fraction of the coordinate blocks only.

A block is one row of a parameter tensor (of its full, global tensor: an output neuron's
weights, one token's embedding) or a whole vector (a norm's gain, a bias). At a selection step
every candidate tensor is trainable for one backward; the blocks are ranked by the norm of
their gradient (each shard's per-row sums of squares, reduced over the tensor axes, so every
rank ranks alike) and taken in that order while their elements fit in (1 - train.method.sparsity)
of the total. Rows, not whole tensors: in a small model the embedding and the output layer are
close to half the weights, so a tenth of the elements never fits one of them whole, and they
are where fine-tuning moves the loss most (the rows of the frequent tokens).

A tensor none of whose blocks is selected is frozen (requires_grad False: no saved input for
dW, no dW GEMM, no reduce-scatter, no data all-reduce). A tensor with selected rows computes
its shard's whole gradient; the moment that gradient is final (LOMO's hand-off,
base.on_final_gradients) its selected rows are copied out and the gradient is freed, so only
the selected rows' gradients live until the update. AdamW's moments and step count are kept
per selected row; rows that stay selected across a reselection keep theirs.

The selection is redone when the step's loss has not beaten the best so far for
train.method.patience steps (default 1: a batch loss is noisy, so after most steps; the rows
with the steepest gradient change from batch to batch, and bench/lean_quality.py compares
settings). Its backward streams too: at each hand-off the tensor's row norms join those seen
so far and its gradient is held whole; once the held rows exceed the budget by HOLD_SLACK
(fourfold.methods.blockllm) of all elements, the tentative choice (the steepest held blocks,
while they fit) is made and only the rows in it keep their gradient. A block that leaves the
tentative choice never comes back into it (blocks seen later only add to the elements ranked
above it), so the final choice's gradients are all at hand without a second backward; and a
later tensor's rows below the steepest block that left are dropped at its hand-off (a few
rankings a selection, not one per tensor).

Checkpoints: the selection (global rows per tensor) is in the state's facts; each tensor's
moments and step counts are saved as (its chosen rows, the shard's columns), the rows gathered
over the axes that split them (for the save only), so they reshard to any grid as AdamW's do.

Memory: gradients, moments and step counts of the selected rows; the shard gradient being
handed off; a selection step also up to HOLD_SLACK of the elements' gradients more
and one float64 norm per row of every candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fourfold.config import TrainConfig
from fourfold.methods.blockllm import HOLD_SLACK, BlockLLMOptions
from fourfold.noise import chunk_elements
from fourfold.parallel import Axis, Layout, ParallelModel
from fourfold.train.methods.base import (CHUNK_ELEMENTS, ParamView, PhaseHooks, StepData,
                                         StepGuard, StepResult, TrainingMethod,
                                         arm_on_last_micro_step, backward_pass, check_meta,
                                         live_grad_bytes, on_final_gradients, padded_dims,
                                         param_views, reduce_loss)

EPS = 1e-8  # AdamW's, as train/optim.build_optimizer


@dataclass
class Candidate:
    """A trainable tensor seen as rows of its full tensor (a vector: one row, the whole of it).
    This rank holds global rows [first, first + count), each as `local_cols` elements."""

    view: ParamView
    rows: int  # rows of the full tensor
    row_size: int  # elements of a full row
    first: int
    count: int
    local_cols: int
    replicas: int  # ranks over x, y, z that hold each element

    def matrix(self, t: torch.Tensor) -> torch.Tensor:
        """A shard-shaped tensor as (local rows, local cols)."""
        return t.reshape(self.count, self.local_cols)

    def local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The local indices of those of the global `rows` (sorted) that this rank holds."""
        lo = int(torch.searchsorted(rows, self.first))
        hi = int(torch.searchsorted(rows, self.first + self.count))
        return rows[lo:hi] - self.first


def candidates(views: list[ParamView], grid: Any) -> list[Candidate]:
    """Every view as rows, in name order (the same order on every grid)."""
    out = []
    for v in sorted(views, key=lambda v: v.name):
        if v.param.dim() >= 2:
            rows, first, count = v.full_shape[0], v.offsets[0], v.param.shape[0]
            row_size = math.prod(v.full_shape[1:])
        else:
            rows, first, count, row_size = 1, 0, 1, math.prod(v.full_shape)
        out.append(Candidate(v, rows, row_size, first, count, v.param.numel() // max(count, 1),
                             v.layout.replicas(grid.shape)))
    return out


def row_norms_sq(rows: torch.Tensor, replicas: int) -> torch.Tensor:
    """This shard's part of each row's squared norm (float64; `replicas` ranks hold each
    element, so it is counted once over them), in blocks of about chunk_elements (1 MiB on a
    CPU, whose cache keeps it; 16 MiB on an accelerator, where each block's ~4 kernel launches
    would otherwise weigh more than its bytes): no float64 copy of the whole shard."""
    step = max(1, chunk_elements(rows.device) // max(1, rows.shape[1]))
    out = torch.empty(rows.shape[0], dtype=torch.float64, device=rows.device)
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = rows[start:start + step].double().pow_(2).sum(1)
    return out / replicas


def choose_rows(norms: list[torch.Tensor | None], sizes: list[int], budget: float,
                rows: list[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
    """The blocks by descending norm (ties: tensor, then row, in order), taken while their
    elements fit in `budget`; a block larger than the budget on its own is passed over, and if
    every block is, the steepest is taken. norms[i]: tensor i's rows' norms (None: not seen
    yet), for its rows rows[i] (sorted; default: all of them, in order). Per tensor: its chosen
    rows (sorted), or None for a tensor not seen."""
    seen = [i for i, n in enumerate(norms) if n is not None]
    if not seen:
        return [None] * len(norms)
    ids = [rows[i] if rows is not None and rows[i] is not None else torch.arange(norms[i].numel())
           for i in range(len(norms)) if norms[i] is not None]
    flat = torch.cat([norms[i].cpu() for i in seen])
    numels = [norms[i].numel() for i in seen]
    size = torch.tensor([float(sizes[i]) for i in seen], dtype=torch.float64)
    size = torch.repeat_interleave(size, torch.tensor(numels))
    order = torch.sort(flat, descending=True, stable=True).indices
    fits = size[order] <= budget
    if fits.any():
        order = order[fits]
        order = order[torch.cumsum(size[order], 0) <= budget]
    else:
        order = order[:1]
    # a mask over the blocks in (tensor, row) order, cut into the tensors' parts: each part's
    # rows stay sorted, with no second sort
    chosen = torch.zeros(flat.numel(), dtype=torch.bool)
    chosen[order] = True
    out: list[torch.Tensor | None] = [None] * len(norms)
    for i, ids_i, mask in zip(seen, ids, torch.split(chosen, numels)):
        out[i] = ids_i[mask]
    return out

class BlockLLM(TrainingMethod):
    name = "blockllm"

    def __init__(self, pmodel: ParallelModel, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> None:
        options = cfg.options()
        assert isinstance(options, BlockLLMOptions)
        self.views = param_views(pmodel, tied_output)  # the candidates: trainable at the start
        self.grid, self.comm = pmodel.grid, pmodel.comm
        self.hooks = hooks or PhaseHooks()
        self.cands = candidates(self.views, self.grid)
        self._index = {id(c.view.param): i for i, c in enumerate(self.cands)}
        self._by_name = {c.view.name: c for c in self.cands}
        self.sparsity, self.patience = options.sparsity, options.patience
        self.beta1, self.beta2 = cfg.beta1, cfg.beta2
        self.weight_decay = cfg.effective_weight_decay()
        self.grad_clip = cfg.grad_clip
        self.sizes = {c.view.name: math.prod(c.view.full_shape) for c in self.cands}
        self.row_sizes = [c.row_size for c in self.cands]
        self.budget = (1.0 - self.sparsity) * sum(self.sizes.values())
        # a selection's backward ranks the rows it holds only when they outgrow this: a
        # HOLD_SLACK share of the elements beyond the budget
        self.hold_limit = self.budget + HOLD_SLACK * sum(self.sizes.values())
        # the selection: per candidate its chosen global rows (sorted), None before the first
        self.rows: list[torch.Tensor] | None = None
        self.selecting_next = True
        self.best = math.inf
        self.since_best = 0
        self.reselections = 0  # selections after the first
        # per candidate with chosen local rows: the rows' gradients (after a backward) and
        # AdamW state: exp_avg, exp_avg_sq (local rows x local cols), step (local rows)
        self.grads: dict[int, torch.Tensor] = {}
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        # what the last selection saw (tests read them): each tensor's row norms
        self.norms: dict[str, torch.Tensor] = {}
        self._seen: list[torch.Tensor | None] = []  # a selection's row norms so far
        self._held: dict[int, torch.Tensor] = {}  # the global rows whose gradients it holds
        self._held_elements = 0  # their elements (of the full rows)
        # the last selection's backward: its rankings of held rows (the final one not counted)
        # and the rows it dropped at their hand-off, below the floor
        self.rankings, self.dropped_at_hand_off = 0, 0
        # the norm below which no block can enter the choice (None: not known yet)
        self._floor: float | None = None
        self._armed = False  # on the last micro-step of a backward
        self._selecting = False
        self._release = on_final_gradients(pmodel, self.views, self._on_grad_ready)

    # ---- the selection ----------------------------------------------------------------------

    @property
    def selected(self) -> dict[str, list[int]] | None:
        """The chosen global rows of each tensor that has any, by name."""
        if self.rows is None:
            return None
        return {c.view.name: r.tolist() for c, r in zip(self.cands, self.rows) if r.numel()}

    def selected_elements(self) -> int:
        return 0 if self.rows is None else sum(
            r.numel() * c.row_size for c, r in zip(self.cands, self.rows))

    def _set_trainable(self, every: bool) -> None:
        for c, r in zip(self.cands, self.rows or [None] * len(self.cands)):
            c.view.param.requires_grad_(every or (r is not None and r.numel() > 0))

    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        i = self._index.get(id(p))
        if not self._armed or i is None or p.grad is None:
            return
        self.peak_grad_bytes = max(self.peak_grad_bytes, live_grad_bytes(self.views)
                                   + sum(g.numel() * g.element_size()
                                         for g in self.grads.values()))
        c = self.cands[i]
        if self._selecting:
            full = torch.zeros(c.rows, dtype=torch.float64, device=self.grid.device)
            full[c.first:c.first + c.count] = row_norms_sq(c.matrix(p.grad), c.replicas)
            if self.grid.world_size > 1:  # data replicas hold the same (all-reduced) gradients
                full = self.comm.all_reduce(full, "tensor").wait()
            norms = self._seen[i] = full.sqrt().cpu()
            # the rows not below the floor are held (a gather of them, or the whole gradient,
            # no copy) until the held rows outgrow the hold limit
            every = torch.arange(c.rows)
            keep = every if self._floor is None else torch.nonzero(norms >= self._floor)[:, 0]
            self.dropped_at_hand_off += c.rows - keep.numel()
            self.grads[i] = self._subset(i, every, keep, c.matrix(p.grad))
            self._held[i] = keep
            self._held_elements += keep.numel() * c.row_size
            if self._held_elements > self.hold_limit:
                self._compact()
            p.grad = None  # it may be held whole (no copy): its buffer is not let go of
        else:
            rows = self.cands[i].local_rows(self.rows[i]).to(p.grad.device)
            self.grads[i] = c.matrix(p.grad).index_select(0, rows)  # a copy of the rows
            self._release(p)

    def _compact(self) -> None:
        """The choice so far, made from the held rows alone (a block that left it never comes
        back, so the rows outside it need not be ranked again): the held gradients of the
        rows outside it are freed. The floor rises to the steepest block that left it and
        fits the budget: with the blocks ranked above it, that block overfills the budget, so
        a block below it, seen now or later, never enters the choice."""
        self.rankings += 1
        held = [self._held.get(j) for j in range(len(self.cands))]
        tentative = choose_rows([None if h is None else self._seen[j][h]
                                 for j, h in enumerate(held)], self.row_sizes, self.budget, held)
        for j, g in list(self.grads.items()):
            if self.row_sizes[j] <= self.budget:
                left = self._held[j][~torch.isin(self._held[j], tentative[j])]
                if left.numel():
                    steepest = float(self._seen[j][left].max())
                    self._floor = steepest if self._floor is None else max(self._floor, steepest)
            self.grads[j] = self._subset(j, self._held[j], tentative[j], g)
        self._held = {j: tentative[j] for j in self.grads}
        self._held_elements = sum(r.numel() * self.cands[j].row_size
                                  for j, r in self._held.items())

    def _subset(self, i: int, held: torch.Tensor, keep: torch.Tensor, g: torch.Tensor
                ) -> torch.Tensor:
        """The rows of `g` (the local ones of global rows `held`) that are in `keep`."""
        if keep.numel() == held.numel():
            return g
        c = self.cands[i]
        local_held, local_keep = c.local_rows(held), c.local_rows(keep)
        if not bool(torch.isin(local_keep, local_held).all()):
            raise RuntimeError(f"blockllm: {c.view.name}: a block came back into the choice "
                               "after its gradient was freed (a bug)")
        # index_select: about 4x the speed of g[index] on a CPU (a gather of whole rows)
        return g.index_select(0, torch.searchsorted(local_held, local_keep).to(g.device))

    def _backward(self, pmodel: ParallelModel, data: StepData, selecting: bool) -> float:
        self.grads, self._selecting = {}, selecting
        if selecting:
            self._seen, self._held, self._held_elements = [None] * len(self.cands), {}, 0
            self._floor, self.rankings, self.dropped_at_hand_off = None, 0, 0
        try:
            return reduce_loss(pmodel, backward_pass(pmodel, arm_on_last_micro_step(
                data, lambda on: setattr(self, "_armed", on))))
        finally:
            self._armed = self._selecting = False

    def _select(self, pmodel: ParallelModel, data: StepData) -> float:
        """The selection's backward (every candidate trainable): returns its loss and leaves
        the chosen rows' gradients in self.grads and the new selection in self.rows."""
        self._set_trainable(True)
        loss = self._backward(pmodel, data, selecting=True)
        for i, c in enumerate(self.cands):  # a tensor without a gradient ranks as a zero one
            if self._seen[i] is None:
                self._seen[i] = torch.zeros(c.rows, dtype=torch.float64)
        new = choose_rows(self._seen, self.row_sizes, self.budget)
        for i in list(self.grads):
            self.grads[i] = self._subset(i, self._held[i], new[i], self.grads[i])
        self.norms = {c.view.name: n for c, n in zip(self.cands, self._seen)}
        self._keep_state(new)
        self.rows = new  # every entry is set now
        self._set_trainable(False)
        return loss

    def _keep_state(self, new: list[torch.Tensor | None]) -> None:
        """Carry each row's moments and step count over to the new selection (zeros for a row
        new to it), one tensor at a time."""
        for i, c in enumerate(self.cands):
            old = self.state.pop(i, None)
            local_new = c.local_rows(new[i])
            if local_new.numel() == 0:
                continue
            device, cols = c.view.param.device, c.local_cols
            fresh = {"exp_avg": torch.zeros(local_new.numel(), cols, device=device),
                     "exp_avg_sq": torch.zeros(local_new.numel(), cols, device=device),
                     "step": torch.zeros(local_new.numel(), device=device)}
            if old is not None:
                local_old = c.local_rows(self.rows[i])
                stays = torch.isin(local_new, local_old)
                where = torch.searchsorted(local_old, local_new[stays])
                stays, where = stays.to(device), where.to(device)
                for key, t in fresh.items():
                    t[stays] = old[key][where]
            self.state[i] = fresh

    # ---- the update -------------------------------------------------------------------------

    def _clip(self) -> float:
        """The selected rows' gradient norm over the grid; scales them to train.grad_clip."""
        total = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        for i, g in self.grads.items():
            total += row_norms_sq(g, self.cands[i].replicas).sum()
        if self.grid.world_size > 1:
            total = self.comm.all_reduce(total, "tensor").wait()
        norm = total.sqrt()
        if self.grad_clip > 0 and self.grads:
            coef = (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(list(self.grads.values()), coef.to(torch.float32))
        return float(norm)

    @torch.no_grad()
    def _update(self, lr: float) -> None:
        """AdamW (torch's formula) on the selected rows, in row blocks of about CHUNK_ELEMENTS
        so that its temporaries stay small whatever the tensor."""
        b1, b2 = self.beta1, self.beta2
        for i, g in self.grads.items():
            if g.shape[0] == 0:  # the chosen rows of this tensor lie on other ranks
                continue
            c, s = self.cands[i], self.state[i]
            decay = lr * self.weight_decay if c.view.decay else 0.0
            weights = c.matrix(c.view.param.data)
            local = c.local_rows(self.rows[i]).to(g.device)
            step = max(1, CHUNK_ELEMENTS // max(1, c.local_cols))
            s["step"] += 1
            for a in range(0, g.shape[0], step):
                rows, grad = local[a:a + step], g[a:a + step]
                m, v, t = s["exp_avg"][a:a + step], s["exp_avg_sq"][a:a + step], \
                    s["step"][a:a + step, None]
                m.lerp_(grad, 1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (v.sqrt() / (1 - b2 ** t).sqrt()).add_(EPS)
                w = weights.index_select(0, rows)
                if decay:
                    w.mul_(1 - decay)
                w.sub_(m / denom * (lr / (1 - b1 ** t)))
                weights.index_copy_(0, rows, w)

    def step(self, pmodel: ParallelModel, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        self.hooks.step_start()
        if self.selecting_next:
            if self.best < math.inf:  # not the first selection
                self.reselections += 1
            loss = self._select(pmodel, data)
            self.selecting_next = False
        else:
            loss = self._backward(pmodel, data, selecting=False)
        norm = self._clip()
        reason = guard.check(loss, norm) if guard is not None else None
        if reason is None:
            self._update(lr)
            if loss < self.best:
                self.best, self.since_best = loss, 0
            else:
                self.since_best += 1
                if self.since_best >= self.patience:
                    self.selecting_next, self.since_best = True, 0
        self.grads = {}
        return StepResult(loss, norm, reason is not None, reason or "")

    # ---- state ------------------------------------------------------------------------------

    def _row_axes(self, c: Candidate) -> tuple[Axis, ...]:
        """The grid axes that split the tensor's rows (a vector is one row: none)."""
        return padded_dims(c.view)[0] if c.view.param.dim() >= 2 else ()

    def state_layout(self, key: str) -> Layout | None:
        """A tensor's chosen rows' state is saved as (chosen rows, the shard's columns): the
        rows whole, the columns split as the parameter's (a step count: every row)."""
        name, field = key.rsplit("/", 1)
        c = self._by_name.get(name)
        if c is None:
            return None
        if field == "step":
            return Layout(((),))
        dims = padded_dims(c.view)
        return Layout(((),) + (dims[1:] if c.view.param.dim() >= 2 else dims))

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Collective on a grid: each tensor's state is summed into its (chosen rows, shard
        columns) over the axes that split its rows (zeros elsewhere, so the sum is exact)."""
        tensors = {}
        for i, c in enumerate(self.cands):
            rows = None if self.rows is None else self.rows[i]
            if rows is None or rows.numel() == 0:
                continue
            s, axes = self.state.get(i), self._row_axes(c)
            at = torch.searchsorted(rows, c.local_rows(rows) + c.first)
            cols = tuple(c.view.param.shape[1:]) if c.view.param.dim() >= 2 else (c.local_cols,)
            for field in ("exp_avg", "exp_avg_sq", "step"):
                shape = (rows.numel(),) + (() if field == "step" else (c.local_cols,))
                if not axes and s is not None:
                    t = s[field]
                else:
                    t = torch.zeros(shape, device=c.view.param.device)
                    if s is not None:
                        t[at.to(t.device)] = s[field]
                    for axis in axes:
                        t = self.comm.all_reduce(t, axis).wait()
                tensors[f"{c.view.name}/{field}"] = t if field == "step" else t.reshape(
                    rows.numel(), *cols)
        return tensors, {"kind": self.name, "selected": self.selected,
                         "selecting_next": self.selecting_next,
                         "best": None if math.isinf(self.best) else self.best,
                         "since_best": self.since_best, "reselections": self.reselections}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values())

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)
        selected = meta["selected"]
        if selected is None:
            self.rows = None
        else:
            self.rows = [torch.tensor(selected.get(c.view.name, []), dtype=torch.long)
                         for c in self.cands]
        self.selecting_next = bool(meta["selecting_next"])
        self.best = math.inf if meta["best"] is None else float(meta["best"])
        self.since_best, self.reselections = int(meta["since_best"]), int(meta["reselections"])
        self.state = {}
        for i, c in enumerate(self.cands):  # this rank's rows of each tensor's chosen rows
            rows = None if self.rows is None else self.rows[i]
            keys = {k: f"{c.view.name}/{k}" for k in ("exp_avg", "exp_avg_sq", "step")}
            if rows is None or not all(key in tensors for key in keys.values()):
                continue
            at = torch.searchsorted(rows, c.local_rows(rows) + c.first)
            if at.numel():
                self.state[i] = {k: tensors[key].reshape(
                    (rows.numel(),) if k == "step" else (rows.numel(), -1))[at]
                    .to(c.view.param.device, copy=True) for k, key in keys.items()}
        self._set_trainable(self.rows is None)

