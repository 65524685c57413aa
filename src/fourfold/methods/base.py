"""The declaration of a training method: `MethodSpec`, and `MethodOptions`, the base of each
method's options. Nothing here imports torch (see fourfold.methods)."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fourfold.errors import ConfigError

if TYPE_CHECKING:
    from fourfold.config import TrainConfig
    from fourfold.parallel.grid import GridShape

# When a method changes the weights: after the backward of a step (AdamW, BlockLLM, GaLore),
# inside backward as each shard's gradient becomes final (LOMO, AdaLomo: such a method cannot
# accumulate micro-steps), or from forwards alone (MeZO, ES: no backward at all).
UpdateTime = Literal["after_backward", "in_backward", "forward_only"]


@dataclass
class MethodOptions:
    """A training method's own options, the `[train.method]` section of a config (keys
    train.method.NAME on the command line). A subclass adds its fields, each with its paper's
    default, and `check` for the values a field's type allows but the method does not."""

    def check(self, train: TrainConfig) -> None:
        """Raise ConfigError, one line naming the key (train.method.NAME) and what is allowed,
        for an impossible value; `train` is the rest of the [train] section."""


@dataclass(frozen=True)
class MethodSpec:
    """Everything fourfold needs to know of a training method, under its key (train.optimizer).

    `implementation` and `planner` name where the method's two halves live, as "module:name"
    (imported when first used) or the objects themselves: the TrainingMethod class that trains
    (fourfold.train.methods.base) and the planner model that predicts its memory and step time
    (fourfold.plan.methods.base.MethodModel)."""

    name: str
    options: type[MethodOptions]
    implementation: str | type
    planner: str | object
    weight_decay: float  # the decoupled weight decay train.weight_decay = "auto" gives it
    update_time: UpdateTime = "after_backward"
    batch_axes: tuple[str, ...] = ("data", "z")  # the grid axes a step's batch is split over
    # parallel.output_loss = "auto" gives it the output layer and loss a block of the vocabulary
    # at a time (parallel/embedding.py): for a method whose peak holds the whole logits
    blocked_loss: bool = False
    # it can train a subset of the parameters (an adapter's: adapter.kind other than none)
    trains_subsets: bool = False
    # its step reads numbers on the host by design (its loss, a projected gradient, a block
    # selection); False: the step keeps them on the device and nothing waits for the host,
    # which a simulated rank (fourfold.simulate) holds it to
    step_reads_host: bool = True
    # its options' keys before they moved into [train.method]: train.OLD -> train.method.NEW,
    # still read (with a deprecation notice)
    renamed: Mapping[str, str] = field(default_factory=dict)

    def batch_shards(self, shape: GridShape) -> int:
        """How many shards a step's batch is split into on `shape` (over `batch_axes`)."""
        return math.prod(getattr(shape, a) for a in self.batch_axes)

    @property
    def accumulates(self) -> bool:
        """Whether a step can be split into train.grad_accum micro-steps (not while the
        weights change inside backward)."""
        return self.update_time != "in_backward"

    @property
    def forward_only(self) -> bool:
        return self.update_time == "forward_only"

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.options)]

    def build_class(self) -> type:
        """The TrainingMethod class (imports it: torch)."""
        return resolve(self.implementation)  # type: ignore[return-value]

    def planner_model(self) -> Any:
        """The planner model (imports it)."""
        return resolve(self.planner)


def resolve(ref: str | object) -> Any:
    """An object named "module:attribute", or `ref` itself when it is not a string."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def positive(key: str, value: float) -> None:
    """A one-line ConfigError unless `value` is a positive finite number."""
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"train.method.{key} = {value}: must be a positive number")


def at_least(key: str, value: int, least: int, why: str = "") -> None:
    """A one-line ConfigError unless `value` >= `least` (`why`: what the bound is for)."""
    if value < least:
        raise ConfigError(f"train.method.{key} = {value}: must be at least {least}{why}")
