"""BlockLLM (Ramesh et al. 2024): AdamW on a selected fraction of the parameter blocks only.

A block is one parameter tensor (the full tensor: on a grid every shard of it is in or out
together). At a selection step every candidate is trainable for one backward; the blocks are
ranked by the norm of their full gradient (each shard's sum of squares, reduced over the tensor
axes, so every rank ranks alike) and taken in that order while their elements fit in
(1 - train.block_sparsity) of the total. The others are frozen (requires_grad False: no saved
input for dW, no dW GEMM, no reduce-scatter, no data all-reduce) and lose their AdamW moments.
The selection is redone when the step's loss has not beaten the best so far for
train.block_patience steps.

The selection's backward holds no full set of gradients: each gradient's norm is taken the
moment it is final (LOMO's hand-off, base.on_final_gradients; on a grid one float64 all-reduce
over the tensor axes per tensor) and the gradient is kept only while it is in the selection of
the blocks seen so far (vectors: kept), else freed. The final selection is made from all norms,
as before; a chosen matrix whose gradient was freed on the way (it did not fit beside the
blocks seen by then, and a later, steeper block displaced a larger one) gets it from a second
backward of those blocks alone.

Memory: gradients and moments of the selected blocks; a selection step adds one more tensor's
gradient at a time (the one being handed off) and the vectors' gradients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import torch
from torch import nn

from fourfold.config import TrainConfig
from fourfold.train.methods.adamw import AdamW, backward_pass
from fourfold.train.methods.base import (Guard, StepData, StepResult, check_meta,
                                         live_grad_bytes, on_final_gradients, param_views,
                                         reduce_loss, shard_norm_sq)
from fourfold.train.optim import set_lr


def choose_blocks(norms: dict[str, float], sizes: dict[str, int], budget: float) -> list[str]:
    """The blocks by descending gradient norm (ties by name), each taken if it still fits in
    `budget` elements; if none fits, the steepest. Sorted by name."""
    order = sorted(norms, key=lambda n: (-norms[n], n))
    chosen, used = [], 0
    for name in order:
        if used + sizes[name] <= budget:
            chosen.append(name)
            used += sizes[name]
    return sorted(chosen) if chosen else order[:1]


class BlockLLM(AdamW):
    name = "blockllm"
    update_time = "after_backward"

    def __init__(self, pmodel: Any, cfg: TrainConfig, tied_output: bool = False) -> None:
        super().__init__(pmodel, dataclasses.replace(cfg, optimizer="adamw"), tied_output)
        self.views = param_views(pmodel, tied_output)  # the candidates: trainable at the start
        self._view = {id(v.param): v for v in self.views}
        self._by_name = {v.name: v for v in self.views}
        self.grid, self.comm = pmodel.grid, pmodel.comm
        self.sparsity, self.patience = cfg.block_sparsity, cfg.block_patience
        self.sizes = {v.name: math.prod(v.full_shape) for v in self.views}
        self.budget = (1.0 - self.sparsity) * sum(self.sizes.values())
        self.selected: list[str] | None = None  # None: select at the next step
        self.best = math.inf
        self.since_best = 0
        self.reselections = 0  # selections after the first
        # what the last selection saw (tests read them): each block's gradient norm, and the
        # chosen blocks whose gradients had been freed on the way (so recomputed)
        self.norms: dict[str, float] = {}
        self.recomputed: list[str] = []
        self._held: set[str] = set()
        self._selecting = False  # in the selection's backward, on its last micro-step
        on_final_gradients(pmodel, self.views, self._on_grad_ready)

    def _set_trainable(self, names: set[str] | None) -> None:
        """Freeze every candidate outside `names` (None: make all trainable); a frozen block's
        gradient and moments go."""
        for v in self.views:
            keep = names is None or v.name in names
            v.param.requires_grad_(keep)
            if not keep:
                v.param.grad = None
                self.optimizer.state.pop(v.param, None)

    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._selecting or p.grad is None or id(p) not in self._view:
            return
        self.peak_grad_bytes = max(self.peak_grad_bytes, live_grad_bytes(self.views))
        view = self._view[id(p)]
        norm_sq = shard_norm_sq(view, p.grad, self.grid.shape).to(self.grid.device)
        if self.grid.world_size > 1:  # data replicas hold the same (all-reduced) gradients
            norm_sq = self.comm.all_reduce(norm_sq, "tensor").wait()
        self.norms[view.name] = float(norm_sq.sqrt())
        # every rank has the same norms, so keeps and frees alike. Vectors (norms, biases) are
        # kept whatever: they cost next to nothing, and they are what a later, steeper matrix
        # most often lets back into the selection
        keep = self._kept_while_selecting()
        self._held.add(view.name)
        for name in [n for n in self._held if n not in keep]:
            held = self._by_name[name].param
            if held.dim() > 1:
                held.grad = None
                self._held.discard(name)

    def _kept_while_selecting(self) -> set[str]:
        """The blocks whose gradients a selection's backward keeps, of those handed off so far."""
        return set(choose_blocks(self.norms, self.sizes, self.budget))

    def _marked(self, data: StepData) -> StepData:
        """`data` with the hand-off armed on its last micro-step only: on one process the hook
        runs after every micro-step's backward, and only the sum is the step's gradient."""
        def losses() -> Iterator[torch.Tensor]:
            for i, loss in enumerate(data.losses()):
                self._selecting = i == data.micro_steps - 1
                yield loss

        return StepData(data.micro_steps, losses)

    def _select(self, pmodel: Any, data: StepData) -> float:
        """The selection's backward (every candidate trainable); returns its loss and leaves
        the gradients of the chosen blocks, and only theirs."""
        self._set_trainable(None)
        self.norms, self._held = {}, set()
        try:
            loss = reduce_loss(pmodel, backward_pass(pmodel, self._marked(data)))
        finally:
            self._selecting = False
        handed_off = set(self.norms)
        for v in self.views:  # a block without a gradient ranks as a zero one (as before)
            self.norms.setdefault(v.name, 0.0)
        self.selected = choose_blocks(self.norms, self.sizes, self.budget)
        chosen = set(self.selected)
        self.recomputed = [v.name for v in self.views if v.name in chosen & handed_off
                           and v.param.grad is None]
        if self.recomputed:  # their backward alone; the kept gradients are left alone
            missing = set(self.recomputed)
            for v in self.views:
                v.param.requires_grad_(v.name in missing)
            backward_pass(pmodel, data)
        self._set_trainable(chosen)
        return loss

    def step(self, pmodel: Any, data: StepData, lr: float, guard: Guard | None = None
             ) -> StepResult:
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        if self.selected is None:
            if self.best < math.inf:  # not the first selection
                self.reselections += 1
            loss = self._select(pmodel, data)
        else:
            loss = reduce_loss(pmodel, backward_pass(pmodel, data))
        norm, reason = self.clip_and_update(pmodel, loss, guard)
        if reason is None:
            if loss < self.best:
                self.best, self.since_best = loss, 0
            else:
                self.since_best += 1
                if self.since_best >= self.patience:
                    self.selected, self.since_best = None, 0
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm, reason is not None, reason or "")

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, _ = super().state_dict()
        return tensors, {"kind": self.name, "selected": self.selected,
                         "best": None if math.isinf(self.best) else self.best,
                         "since_best": self.since_best, "reselections": self.reselections}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)
        self.selected = meta["selected"]
        self._set_trainable(None if self.selected is None else set(self.selected))
        self.best = math.inf if meta["best"] is None else float(meta["best"])
        self.since_best, self.reselections = int(meta["since_best"]), int(meta["reselections"])
        super().load_state_dict(tensors, {"kind": self.name})
