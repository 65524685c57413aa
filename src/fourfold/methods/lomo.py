"""LOMO (Lv et al. 2023, "Full Parameter Fine-tuning for Large Language Models with Limited
Resources") and AdaLomo (Lv et al. 2023, "AdaLomo: Low-memory Optimization with Adaptive
Learning Rate"): the update fused into backward, each shard as its gradient becomes final.

Neither decays the weights by default (nor do their papers): LOMO's SGD steps at learning
rates 10-100x Adam's, and AdaLomo's decay, like its step, is scaled by RMS(w). Given a
train.weight_decay, both decay as lomo-optim does (LOMO: w <- (1 - lr wd) w; AdaLomo:
w <- (1 - lr max(eps_param_rms, RMS(w)) wd) w, before the step) but, as every fourfold method,
never the norm gains, biases or embeddings unless decay_every_parameter (lomo-optim decays
every parameter it trains: decaying a gain pulls the model towards a zero scale rather than
regularising a map)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fourfold.errors import ConfigError
from fourfold.methods.base import MethodOptions, MethodSpec, positive

if TYPE_CHECKING:
    from fourfold.config import TrainConfig

CLIP_MODES = ("none", "value", "two_pass")


@dataclass
class FusedBackwardOptions(MethodOptions):
    # how the gradient is clipped by train.grad_clip: "none"; "value", each element clamped
    # (local, exact on every grid); "two_pass", by the global norm, from a first backward
    # that only computes it (the LOMO paper's way, twice the backward)
    clip_mode: str = "none"
    # train.weight_decay on every parameter, the norms' gains, biases and embeddings too
    # (lomo-optim's); false: on the others only, as every fourfold method
    decay_every_parameter: bool = False

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
    """AdaLomo: Adafactor's factored second moment and a step relative to the weights' RMS,
    with the paper's (and lomo-optim's) defaults."""

    # the second moment's decay: beta2_t = 1 - t^decay_rate at step t (Adafactor's schedule:
    # 0 at the first step, then rising towards 1), not a constant train.beta2
    decay_rate: float = -0.8
    # added to each squared gradient element before its row and column means (Adafactor's
    # epsilon1; lomo-optim's eps[0])
    eps_grad_sq: float = 1e-30
    # the floor of RMS(w) that scales the step (and the weight decay): lr * max(this, RMS(w))
    # (Adafactor's epsilon2; lomo-optim's eps[1])
    eps_param_rms: float = 1e-3
    # the update u = g / sqrt(v) is divided by max(1, RMS(u) / clip_threshold)
    clip_threshold: float = 1.0

    def check(self, train: TrainConfig) -> None:
        super().check(train)
        if not self.decay_rate < 0:
            raise ConfigError(f"train.method.decay_rate = {self.decay_rate}: must be negative "
                              "(beta2_t = 1 - t^decay_rate; Adafactor's and AdaLomo's -0.8)")
        positive("eps_grad_sq", self.eps_grad_sq)
        positive("eps_param_rms", self.eps_param_rms)
        positive("clip_threshold", self.clip_threshold)


_COMMON = dict(update_time="in_backward", weight_decay=0.0, blocked_loss=True,
               renamed={"clip_mode": "clip_mode"})
METHODS = (
    MethodSpec("lomo", LOMOOptions, "fourfold.train.methods.lomo:LOMO",
               "fourfold.plan.methods.lomo:LOMO", **_COMMON),  # type: ignore[arg-type]
    MethodSpec("adalomo", AdaLomoOptions, "fourfold.train.methods.lomo:AdaLomo",
               "fourfold.plan.methods.lomo:ADALOMO", **_COMMON),  # type: ignore[arg-type]
)
