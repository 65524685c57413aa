"""LOMO (Lv et al. 2023, "Full Parameter Fine-tuning for Large Language Models with Limited
Resources") and AdaLomo (Lv et al. 2023, "AdaLomo: Low-memory Optimization with Adaptive
Learning Rate"): the update fused into backward, each shard as its gradient becomes final.

Neither decays the weights by default: LOMO's SGD steps at learning rates 10-100x Adam's and
AdaLomo's step is relative to the weights' size, so lr x 0.1 would shrink the weights that
much faster (bench/lean_quality.py compares)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fourfold.errors import ConfigError
from fourfold.methods.base import MethodOptions, MethodSpec

if TYPE_CHECKING:
    from fourfold.config import TrainConfig

CLIP_MODES = ("none", "value", "two_pass")


@dataclass
class FusedBackwardOptions(MethodOptions):
    # how the gradient is clipped by train.grad_clip: "none"; "value", each element clamped
    # (local, exact on every grid); "two_pass", by the global norm, from a first backward
    # that only computes it (the LOMO paper's way, twice the backward)
    clip_mode: str = "none"

    def check(self, train: TrainConfig) -> None:
        if self.clip_mode not in CLIP_MODES:
            raise ConfigError(f"train.method.clip_mode = {self.clip_mode!r}: choose one of "
                              f"{', '.join(CLIP_MODES)}")
        if train.nan_policy == "skip" and self.clip_mode != "two_pass":
            raise ConfigError(f"train.nan_policy = \"skip\" needs train.method.clip_mode = "
                              f"\"two_pass\" under {train.optimizer} (it updates before the "
                              "step's norm is known); or use nan_policy = \"stop\" or "
                              "\"rollback\"")


@dataclass
class LOMOOptions(FusedBackwardOptions):
    """LOMO: SGD fused into backward."""


@dataclass
class AdaLomoOptions(FusedBackwardOptions):
    """AdaLomo: a factored second moment (train.beta2) and a step relative to the weights."""


_COMMON = dict(update_time="in_backward", weight_decay=0.0, blocked_loss=True,
               renamed={"clip_mode": "clip_mode"})
METHODS = (
    MethodSpec("lomo", LOMOOptions, "fourfold.train.methods.lomo:LOMO",
               "fourfold.plan.methods.lomo:LOMO", **_COMMON),  # type: ignore[arg-type]
    MethodSpec("adalomo", AdaLomoOptions, "fourfold.train.methods.lomo:AdaLomo",
               "fourfold.plan.methods.lomo:ADALOMO", **_COMMON),  # type: ignore[arg-type]
)
