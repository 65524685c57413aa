"""LOMO (Lv et al. 2023): SGD fused into backward. Each shard is updated the moment its gradient
is final and the gradient is freed at once, so no full gradient buffer ever exists.

"Final" on a grid means after the shard's z reduce-scatter and its data all-reduce (the engine's
grad-ready hook, Engine.set_grad_ready_hook); on one process, when autograd has accumulated it
(a post-accumulate-grad hook). With data > 1 a gradient lives until its bucket's all-reduce is
done (at most two buckets in flight); norms and biases, summed over z at the end of backward,
are updated last.

Clipping (train.clip_mode): "value" clamps each element to +-train.grad_clip (local, exact on
every grid); "two_pass" runs backward twice, the first only to compute the global norm (the
paper's way), then clips by train.grad_clip; "none".
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fourfold.config import TrainConfig
from fourfold.train.methods.adamw import backward_pass
from fourfold.train.methods.base import (Guard, StepData, StepResult, TrainingMethod, check_meta,
                                         param_views, reduce_loss)


class FusedBackward(TrainingMethod):
    """The machinery of a method that updates each shard inside backward."""

    update_time = "in_backward"

    def __init__(self, pmodel: Any, cfg: TrainConfig, tied_output: bool = False) -> None:
        self.views = param_views(pmodel, tied_output)
        self._view = {id(v.param): v for v in self.views}
        self.grid, self.comm = pmodel.grid, pmodel.comm
        self.clip_mode, self.grad_clip = cfg.clip_mode, cfg.grad_clip
        self.weight_decay = cfg.weight_decay
        self._phase = ""  # "norm": first pass of two_pass; "update"; "": not in a step
        self._lr, self._scale = 0.0, 1.0
        self._norm_sq = torch.zeros((), dtype=torch.float64)
        self.peak_grad_bytes = 0  # the most gradient bytes alive at one hand-off (tests read it)
        if pmodel.engine is not None:
            pmodel.engine.set_grad_ready_hook(self._on_grad_ready)
        else:
            for v in self.views:
                v.param.register_post_accumulate_grad_hook(self._on_grad_ready)

    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._phase or p.grad is None or id(p) not in self._view:
            return
        live = sum(v.param.grad.numel() * v.param.grad.element_size()
                   for v in self.views if v.param.grad is not None)
        self.peak_grad_bytes = max(self.peak_grad_bytes, live)
        view = self._view[id(p)]
        grad = p.grad
        if self._phase == "norm":
            # elements held by several ranks are counted once (as ParallelModel.clip_grad_norm_)
            self._norm_sq += grad.double().pow(2).sum() / view.layout.replicas(self.grid.shape)
        else:
            if self.clip_mode == "value" and self.grad_clip > 0:
                grad.clamp_(-self.grad_clip, self.grad_clip)
            elif self._scale != 1.0:
                grad.mul_(self._scale)
            self.update(view, grad)
        p.grad = None

    def update(self, view: Any, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, pmodel: Any, data: StepData, lr: float, guard: Guard | None = None
             ) -> StepResult:
        if data.micro_steps != 1:
            raise ValueError(f"{self.name} updates during backward: one micro-step per step, "
                             f"not {data.micro_steps}")
        self._lr, self._scale, norm = lr, 1.0, math.nan
        try:
            if self.clip_mode == "two_pass":
                self._phase = "norm"
                self._norm_sq.zero_()
                loss = reduce_loss(pmodel, backward_pass(pmodel, data))
                total = self._norm_sq.to(self.grid.device)
                if self.grid.world_size > 1:  # data replicas hold the same gradients
                    total = self.comm.all_reduce(total, "tensor").wait()
                norm = float(total.sqrt())
                # nothing has moved yet: a guard (nan_policy = "skip") can still skip the step
                reason = guard(loss, norm) if guard is not None else None
                if reason is not None or not math.isfinite(norm):
                    return StepResult(loss, norm, True, reason or "non-finite gradient norm")
                if self.grad_clip > 0 and norm > self.grad_clip:
                    self._scale = self.grad_clip / (norm + 1e-6)
            self._phase = "update"
            loss = reduce_loss(pmodel, backward_pass(pmodel, data))
        finally:
            self._phase = ""
        if self.clip_mode == "two_pass":
            return StepResult(loss, norm)
        # the update is done: a guard can only report (hence nan_policy "skip" needs two_pass)
        reason = guard(loss, norm) if guard is not None else None
        return StepResult(loss, norm, False, reason or "")

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"kind": self.name}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)


class LOMO(FusedBackward):
    """w <- (1 - lr wd) w - lr g, shard by shard as g becomes final. No optimizer state."""

    name = "lomo"

    def update(self, view: Any, grad: torch.Tensor) -> None:
        p = view.param
        if view.decay and self.weight_decay:
            p.mul_(1.0 - self._lr * self.weight_decay)
        p.add_(grad, alpha=-self._lr)
