"""Training: building a run, the loop, AdamW and its schedule, metrics, sampling, run
directories.

Names are imported on first use, so that `import fourfold.train.goldfish` (or sampling) does
not pull in the whole trainer, the parallel engine and the data pipeline.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Run": "fourfold.train.build",
    "build_run": "fourfold.train.build",
    "RunDirError": "fourfold.train.runs",
    "load_trained": "fourfold.train.runs",
    "generate": "fourfold.train.sampling",
    "StepStats": "fourfold.train.trainer",
    "TrainResult": "fourfold.train.trainer",
    "Trainer": "fourfold.train.trainer",
    "TrainingError": "fourfold.train.trainer",
    "train": "fourfold.train.trainer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from fourfold.train.build import Run, build_run
    from fourfold.train.runs import RunDirError, load_trained
    from fourfold.train.sampling import generate
    from fourfold.train.trainer import StepStats, Trainer, TrainingError, TrainResult, train


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fourfold.train' has no attribute {name!r}")
