"""AdamW (torch's fused kernel, train/optim.py) behind the method interface: every trainable
parameter's gradient from one backward over the step's micro-batches, clipped by its global
norm, and the update skipped on the device when the loss guard says so (no host read)."""

from __future__ import annotations

import math
from typing import Any

import torch

from fourfold.config import TrainConfig
from fourfold.parallel import Layout, ParallelModel
from fourfold.train.checkpoint import OptimizerState
from fourfold.train.methods.base import (PhaseHooks, StepData, StepGuard, StepResult,
                                         TrainingMethod, backward_pass, check_meta)
from fourfold.train.optim import build_optimizer, set_lr


class AdamW(TrainingMethod):
    """AdamW over every trainable parameter. It calls no phase hooks: its peak is its
    gradients and moments, which nothing at a phase's boundary would lower."""

    name = "adamw"

    def __init__(self, pmodel: ParallelModel, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> None:
        self.optimizer = build_optimizer(pmodel.named_parameters(), cfg, tied_output)
        self.grad_clip = cfg.grad_clip
        self._names = {id(p): n for n, p in pmodel.named_parameters()}
        self._layouts = pmodel.layouts()

    def checkpoint_part(self, pmodel: ParallelModel) -> OptimizerState:
        """torch's optimizer state by parameter (optim/NAME/FIELD), as checkpoints have always
        kept AdamW's."""
        return OptimizerState(self.optimizer, pmodel)

    def step(self, pmodel: ParallelModel, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        """The loss and gradient norm stay on the device (0-d tensors): the update is decided
        there (StepGuard.allow)."""
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        loss = pmodel.reduce_over_batch(backward_pass(pmodel, data))
        self.note_gradients(pmodel)
        norm = pmodel.clip_grad_norm_(self.grad_clip if self.grad_clip > 0 else math.inf)
        if guard is None:
            self.optimizer.step()
        else:
            self._step_if(guard.allow(loss, norm))
        self.optimizer.zero_grad(set_to_none=True)  # not needed until the next backward
        return StepResult(loss, norm)

    def _step_if(self, applied: torch.Tensor) -> None:
        """optimizer.step() where the device says so (a bool tensor), without asking the host:
        the fused kernel leaves parameters, moments and step count as they were when its
        found_inf is 1 (as for a mixed-precision step with an overflow)."""
        if not self.optimizer.defaults.get("fused"):
            if bool(applied):  # a host read: the foreach AdamW has no skip on the device
                self.optimizer.step()
            return
        self.optimizer.found_inf = (~applied).float()  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {}
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                tensors[f"{self._names[id(p)]}/{key}"] = value
        return tensors, {"kind": self.name}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)
        by_name = {n: p for group in self.optimizer.param_groups
                   for n, p in zip(group["names"], group["params"])}
        # the moments live with their parameter; the step count too where the kernel wants it
        # there (fused, capturable), else on the CPU, as torch's AdamW makes it
        on_device = any(self.optimizer.defaults.get(k) for k in ("fused", "capturable"))
        for key, value in tensors.items():
            name, field = key.rsplit("/", 1)
            p = by_name[name]
            where = p.device if field != "step" or on_device else torch.device("cpu")
            self.optimizer.state[p][field] = value.to(where, copy=True)

    def state_layout(self, key: str) -> Layout | None:
        # the moments are shaped like the parameter's shard (the step count is a scalar)
        return self._layouts.get(key.rsplit("/", 1)[0])

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                   for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
