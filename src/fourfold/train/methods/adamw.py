"""AdamW behind the method interface: the trainer's optimizer (train/optim.py), unchanged."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fourfold.config import TrainConfig
from fourfold.parallel import Layout
from fourfold.train.methods.base import (Guard, StepData, StepResult, TrainingMethod, check_meta,
                                         reduce_loss)
from fourfold.train.optim import build_optimizer, set_lr


def backward_pass(pmodel: Any, data: StepData,
                  after_forward: Callable[[], None] | None = None) -> torch.Tensor:
    """Backward over the step's micro-batches (the data all-reduce on the last one only);
    returns this rank's summed loss. `after_forward` runs between each micro-step's forward
    and its backward (host_memory.trim_after_autocast_forward)."""
    total = torch.zeros((), dtype=torch.float64)
    for i, loss in enumerate(data.losses()):
        pmodel.set_requires_gradient_sync(i == data.micro_steps - 1)
        if after_forward is not None:
            after_forward()
        loss.backward()
        pmodel.finish_backward()
        total += loss.detach().double().cpu()
    return total


class AdamW(TrainingMethod):
    name = "adamw"

    def __init__(self, pmodel: Any, cfg: TrainConfig, tied_output: bool = False) -> None:
        self.optimizer = build_optimizer(pmodel.named_parameters(), cfg, tied_output)
        self.grad_clip = cfg.grad_clip
        self._names = {id(p): n for n, p in pmodel.named_parameters()}
        self._layouts = pmodel.layouts()

    def step(self, pmodel: Any, data: StepData, lr: float, guard: Guard | None = None
             ) -> StepResult:
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        loss = reduce_loss(pmodel, backward_pass(pmodel, data))
        norm, reason = self.clip_and_update(pmodel, loss, guard)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm, reason is not None, reason or "")

    def clip_and_update(self, pmodel: Any, loss: float, guard: Guard | None
                        ) -> tuple[float, str | None]:
        """After backward: note the gradients' bytes, clip them, let the guard see the loss
        and norm, and step unless it gives a reason not to; (norm, reason)."""
        self.note_gradients(pmodel)
        norm = float(pmodel.clip_grad_norm_(self.grad_clip if self.grad_clip > 0 else math.inf))
        reason = guard(loss, norm) if guard is not None else None
        if reason is None:
            self.optimizer.step()
        return norm, reason

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
