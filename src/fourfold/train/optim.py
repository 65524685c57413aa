"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine learning rate."""

from __future__ import annotations

import math
import warnings
from typing import Iterable

import torch
from torch import nn

from fourfold.config import ConfigError, TrainConfig


def uses_weight_decay(name: str, tied_output: bool = False) -> bool:
    """Whether a parameter (by its fourfold name) gets weight decay.

    Norm gains, biases and embeddings are exempt: decaying them pulls the model towards
    a zero scale or zero vectors rather than regularizing a linear map. A tied output weight is
    the embedding, so it is exempt too. The name decides, not the shape, because on a grid a
    local shard of a matrix can be one-dimensional or tiny.
    """
    parts = name.split(".")
    if parts[-1] == "bias":
        return False
    if len(parts) >= 2 and parts[-2].endswith("norm"):  # attn_norm, ffn_norm, the final norm
        return False
    if "embed" in parts:
        return False
    if tied_output and name == "output.weight":
        return False
    return True


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float,
                 tied_output: bool = False) -> list[dict]:
    """Two AdamW groups: decayed matrices and the exempt rest (see uses_weight_decay)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    decay_names: list[str] = []
    no_decay_names: list[str] = []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if uses_weight_decay(name, tied_output):
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
            no_decay_names.append(name)
    return [
        {"params": decay, "weight_decay": weight_decay, "names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names},
    ]


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], cfg: TrainConfig,
                    tied_output: bool = False) -> torch.optim.AdamW:
    """torch AdamW over the given (local) parameters, fused where the device supports it."""
    if cfg.optimizer != "adamw":  # the others: fourfold.train.methods.build_method
        raise ConfigError(f"train.optimizer = {cfg.optimizer!r}: build_optimizer builds AdamW; "
                          "the others are built by fourfold.train.methods.build_method")
    groups = param_groups(named_params, cfg.effective_weight_decay(), tied_output)
    groups = [g for g in groups if g["params"]]
    common = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, **common, fused=True)
    except (RuntimeError, ValueError, TypeError) as e:  # device or dtype without a fused kernel
        warnings.warn(f"fused AdamW unavailable ({e}); using the foreach implementation",
                      stacklevel=2)
        return torch.optim.AdamW(groups, **common, foreach=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warmup to cfg.lr over
    cfg.warmup_steps, then cosine decay to cfg.min_lr_ratio * cfg.lr at step cfg.steps."""
    peak = cfg.lr
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    decay_steps = cfg.steps - cfg.warmup_steps
    if decay_steps <= 0:
        return peak
    t = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class LRSchedule:
    """lr_at for one run's TrainConfig, as a checkpoint part. The learning rate is a function
    of the step, so the state is only the schedule itself: a run resumed with another schedule
    follows its new config, and `changed` says what differs from the checkpoint's."""

    FIELDS = ("lr", "min_lr_ratio", "warmup_steps", "steps")

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.changed: list[str] = []  # "train.lr 0.001 -> 0.0005", set by load_state_dict

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based)."""
        return lr_at(step, self.cfg)

    def state_dict(self) -> dict[str, float | int]:
        return {name: getattr(self.cfg, name) for name in self.FIELDS}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.changed = [f"train.{name} {state[name]} -> {getattr(self.cfg, name)}"
                        for name in self.FIELDS
                        if name in state and state[name] != getattr(self.cfg, name)]
