"""BlockLLM (Ramesh et al. 2024): AdamW on a selected fraction of the parameter blocks only.

A block is one parameter tensor (the full tensor: on a grid every shard of it is in or out
together). At a selection step every candidate is trainable for one backward; the blocks are
ranked by the norm of their full gradient (each shard's sum of squares, reduced over the grid
in one all-reduce of one float per tensor, so every rank ranks alike) and taken in that order
while their elements fit in (1 - train.block_sparsity) of the total. The others are frozen
(requires_grad False: no saved input for dW, no dW GEMM, no reduce-scatter, no data
all-reduce) and lose their AdamW moments. The selection is redone when the step's loss has not
beaten the best so far for train.block_patience steps.

Memory: gradients and moments of the selected blocks only; a selection step holds the gradients
of all candidates for that one step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from fourfold.config import TrainConfig
from fourfold.train.methods.adamw import AdamW, backward_pass
from fourfold.train.methods.base import (Guard, StepData, StepResult, check_meta, param_views,
                                         reduce_loss)
from fourfold.train.optim import set_lr


class BlockLLM(AdamW):
    name = "blockllm"
    update_time = "after_backward"

    def __init__(self, pmodel: Any, cfg: TrainConfig, tied_output: bool = False) -> None:
        super().__init__(pmodel, dataclasses.replace(cfg, optimizer="adamw"), tied_output)
        self.views = param_views(pmodel, tied_output)  # the candidates: trainable at the start
        self.grid, self.comm = pmodel.grid, pmodel.comm
        self.sparsity, self.patience = cfg.block_sparsity, cfg.block_patience
        self.selected: list[str] | None = None  # None: select at the next step
        self.best = math.inf
        self.since_best = 0
        self.reselections = 0  # selections after the first

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
    def _select(self) -> list[str]:
        local = torch.zeros(len(self.views), dtype=torch.float64, device=self.grid.device)
        for i, v in enumerate(self.views):
            if v.param.grad is not None:
                # elements held by several ranks are counted once
                local[i] = v.param.grad.double().pow(2).sum() / v.layout.replicas(self.grid.shape)
        if self.grid.world_size > 1:  # data replicas hold the same (all-reduced) gradients
            local = self.comm.all_reduce(local, "tensor").wait()
        norms = local.sqrt().tolist()
        sizes = [math.prod(v.full_shape) for v in self.views]
        budget = (1.0 - self.sparsity) * sum(sizes)
        order = sorted(range(len(self.views)), key=lambda i: (-norms[i], self.views[i].name))
        chosen, used = [], 0
        for i in order:
            if used + sizes[i] <= budget:
                chosen.append(self.views[i].name)
                used += sizes[i]
        if not chosen:  # every block is larger than the budget: train the steepest one
            chosen = [self.views[order[0]].name]
        return sorted(chosen)

    def step(self, pmodel: Any, data: StepData, lr: float, guard: Guard | None = None
             ) -> StepResult:
        selecting = self.selected is None
        if selecting:
            self._set_trainable(None)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        loss = reduce_loss(pmodel, backward_pass(pmodel, data))
        self.note_gradients(pmodel)
        if selecting:
            if self.best < math.inf:  # not the first selection
                self.reselections += 1
            self.selected = self._select()
            self._set_trainable(set(self.selected))
        norm = float(pmodel.clip_grad_norm_(self.grad_clip if self.grad_clip > 0 else math.inf))
        reason = guard(loss, norm) if guard is not None else None
        if reason is None:
            self.optimizer.step()
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
