"""What the planner asks of a training method's model: the memory its gradients and state take
on a rank, the transient of its update, and how its step differs from a forward + backward.

Each method's model is registered with the method (fourfold.methods: MethodSpec.planner);
`method_model` finds it. The rank model (plan/memory.py) and the step-time model
(plan/perf.py) call these and know no method by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fourfold.methods import MethodSpec, method_spec
from fourfold.plan.schedule import Collective, Op

if TYPE_CHECKING:
    from fourfold.config import ModelConfig, TrainConfig
    from fourfold.parallel.grid import GridShape
    from fourfold.plan.memory import Precision
    from fourfold.plan.perf import Rates


@dataclass(frozen=True)
class MethodState:
    """Per rank: the most gradient bytes alive at once, and the optimizer state's bytes."""

    grads: int
    optimizer: int


@dataclass(frozen=True)
class MethodCost:
    """How a training method's step differs from AdamW's, for plan/perf.py predict_step."""

    forwards: int  # forward-only methods: forwards a rank runs per step (0: forward + backward)
    passes: int  # forward + backward passes per step (lomo/adalomo two_pass clipping: 2)
    update_s: float  # the method's own work per step (AdamW: its fused update)


class MethodModel:
    """A training method as the planner sees it. `state` and `cost` are the method's own; the
    rest default to a method that adds nothing."""

    # what the plan's step-time column stands for under this method, where that is a bound or
    # rests on a CPU-only measurement (None: a forward + backward and the update, as AdamW's)
    time_note: str | None = None
    # it imports torch._dynamo (torch.optim does): 70 MiB on a host (plan/memory.py)
    imports_dynamo: bool = False

    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        raise NotImplementedError

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        raise NotImplementedError

    def update_bytes(self, model: ModelConfig, shape: GridShape, train: TrainConfig) -> int:
        """The largest transient of its update after backward, beyond every gradient."""
        return 0

    def collectives(self, model: ModelConfig, shape: GridShape, train: TrainConfig
                    ) -> list[Collective]:
        """Its own collectives in one step, per rank, beyond the model's schedule (each
        exposed: they run inside the method's update)."""
        return []


def method_model(optimizer: str) -> MethodModel:
    """The planner model of train.optimizer = `optimizer`."""
    return method_spec(optimizer).planner_model()


def spec_of(train: TrainConfig | None) -> MethodSpec:
    """The declaration of `train`'s method (None: AdamW, the planner's default)."""
    return method_spec("adamw" if train is None else train.optimizer)


def on_axes(shape: GridShape, axes: tuple[str, ...], op: Op, nbytes: float, calls: int = 1,
            every: int = 1) -> list[Collective]:
    """A method's own collective, once over each of `axes` that splits on `shape`."""
    return [Collective(a, op, int(nbytes), calls, "step_method", every=every)
            for a in axes if getattr(shape, a) > 1]
