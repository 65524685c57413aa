"""Training methods behind one interface (base.TrainingMethod): AdamW and the memory-lean ones.

`build_method(pmodel, cfg)` picks the class for `train.optimizer`. Modules are imported only
for the method asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from fourfold.config import TrainConfig
from fourfold.train.methods.base import (ParamView, StepData, StepResult, TrainingMethod,
                                         batch_shard, param_views)

# train.optimizer -> (module, class)
METHODS: dict[str, tuple[str, str]] = {
    "adamw": ("fourfold.train.methods.adamw", "AdamW"),
    "lomo": ("fourfold.train.methods.lomo", "LOMO"),
    "adalomo": ("fourfold.train.methods.lomo", "AdaLomo"),
    "mezo": ("fourfold.train.methods.zeroth", "MeZO"),
    "es": ("fourfold.train.methods.zeroth", "EvolutionStrategies"),
    "blockllm": ("fourfold.train.methods.blockllm", "BlockLLM"),
    "galore": ("fourfold.train.methods.galore", "GaLore"),
}


def method_batch_axes(name: str) -> tuple[str, ...]:
    """The grid axes that train.optimizer = `name` splits a step's batch over."""
    if name not in METHODS:
        return ("data", "z")
    module, cls = METHODS[name]
    return getattr(importlib.import_module(module), cls).batch_axes


def build_method(pmodel: Any, cfg: TrainConfig, tied_output: bool = False) -> TrainingMethod:
    """The training method named by cfg.optimizer, over pmodel's trainable local shards."""
    if cfg.optimizer not in METHODS:
        raise ValueError(f"train.optimizer = {cfg.optimizer!r} is not built; built: "
                         f"{', '.join(METHODS)}")
    module, cls = METHODS[cfg.optimizer]
    return getattr(importlib.import_module(module), cls)(pmodel, cfg, tied_output)


__all__ = ["METHODS", "ParamView", "StepData", "StepResult", "TrainingMethod", "batch_shard",
           "build_method", "method_batch_axes", "param_views"]
