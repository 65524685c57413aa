"""AdamW (Loshchilov & Hutter 2019), torch's fused kernel, over every trainable parameter:
the default method, and the only one that trains an adapter's subset of the parameters."""

from __future__ import annotations

from dataclasses import dataclass

from fourfold.methods.base import MethodOptions, MethodSpec


@dataclass
class AdamWOptions(MethodOptions):
    """AdamW has no options of its own: train.lr, beta1, beta2, weight_decay and grad_clip."""


METHODS = (MethodSpec("adamw", AdamWOptions, "fourfold.train.methods.adamw:AdamW",
                      "fourfold.plan.methods.adamw:ADAMW", weight_decay=0.1,
                      trains_subsets=True, step_reads_host=False),)
