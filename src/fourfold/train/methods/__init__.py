"""Training methods behind one interface (base.TrainingMethod): AdamW and the memory-lean ones,
each declared in fourfold.methods (its options, defaults and what it asks of the engine).

`build_method(pmodel, cfg)` builds the one train.optimizer names, importing only its module.
"""

from __future__ import annotations

from typing import Any

from fourfold.config import TrainConfig
from fourfold.methods import method_spec
from fourfold.train.methods.base import (ParamView, StepData, StepResult, TrainingMethod,
                                         batch_shard, param_views)


def build_method(pmodel: Any, cfg: TrainConfig, tied_output: bool = False) -> TrainingMethod:
    """The training method named by cfg.optimizer, over pmodel's trainable local shards."""
    method = method_spec(cfg.optimizer).build_class()(pmodel, cfg, tied_output)
    assert isinstance(method, TrainingMethod)
    return method


__all__ = ["ParamView", "StepData", "StepResult", "TrainingMethod", "batch_shard",
           "build_method", "param_views"]
