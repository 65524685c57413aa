"""Training methods behind one interface (base.TrainingMethod): AdamW and the memory-lean ones,
each declared in fourfold.methods (its options, defaults and what it asks of the engine).

`build_method(pmodel, cfg)` builds the one train.optimizer names, importing only its module.
"""

from __future__ import annotations

from fourfold.config import TrainConfig
from fourfold.methods import method_spec
from fourfold.parallel import ParallelModel
from fourfold.train.methods.base import (ParamView, PhaseHooks, StepData, StepResult,
                                         TrainingMethod, batch_shard, param_views)


def build_method(pmodel: ParallelModel, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> TrainingMethod:
    """The training method named by cfg.optimizer, over pmodel's trainable local shards;
    `hooks`: what it calls at its phases' boundaries (the run's host-memory policy's)."""
    method = method_spec(cfg.optimizer).build_class()(pmodel, cfg, tied_output,
                                                      hooks or PhaseHooks())
    assert isinstance(method, TrainingMethod)
    return method


__all__ = ["ParamView", "PhaseHooks", "StepData", "StepResult", "TrainingMethod", "batch_shard",
           "build_method", "param_views"]
