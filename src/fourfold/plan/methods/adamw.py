"""AdamW's planner model: every gradient, two moments, one fused pass to update."""

from __future__ import annotations

from fourfold.config import ModelConfig, TrainConfig
from fourfold.parallel.grid import GridShape
from fourfold.plan.memory import Precision
from fourfold.plan.methods.base import MethodCost, MethodModel, MethodState
from fourfold.plan.perf import Rates
from fourfold.plan.schedule import local_param_numel


def adamw_bytes_per_element(precision: Precision) -> int:
    """Bytes AdamW's update moves per parameter: it reads parameters, gradients and both
    moments and writes parameters and moments, one pass, at copy speed; clipping first reads
    the gradients for their norm, then scales them in place."""
    return (2 * precision.param_bytes + precision.grad_bytes + 2 * precision.optimizer_bytes
            + 3 * precision.grad_bytes)


def adamw_update_seconds(numel: int, rates: Rates, precision: Precision) -> float:
    """AdamW's update of `numel` parameters on a rank."""
    return numel * adamw_bytes_per_element(precision) / rates.bytes_per_s


class AdamWModel(MethodModel):
    imports_dynamo = True  # torch.optim

    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        numel = sum(local_param_numel(model, shape).values())
        return MethodState(numel * precision.grad_bytes, numel * precision.optimizer_bytes)

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        numel = sum(local_param_numel(model, shape).values())
        return MethodCost(0, 1, adamw_update_seconds(numel, rates, precision))


ADAMW = AdamWModel()
