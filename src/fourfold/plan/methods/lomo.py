"""LOMO's and AdaLomo's planner model: one tensor's gradient alive at a time (the largest
block; with data > 1 the buffers of up to two buckets, not counted), the update inside
backward; AdaLomo's factored statistics and their all-reduces."""

from __future__ import annotations

from typing import cast

from fourfold.config import ModelConfig, TrainConfig
from fourfold.methods.lomo import FusedBackwardOptions
from fourfold.parallel.grid import GridShape
from fourfold.plan.memory import (Precision, axes_parts, largest_tensor_numel, local_matrices,
                                  local_vector_numel, matrix_layouts, vector_layouts)
from fourfold.plan.methods.base import MethodCost, MethodModel, MethodState, on_axes
from fourfold.plan.perf import Rates
from fourfold.plan.schedule import Collective, local_param_numel


class LOMOModel(MethodModel):
    """LOMO: no state; its update reads the gradient once, the weights read and written."""

    time_note = ("step time: forward + backward with lomo's update inside it (twice with "
                 "clip_mode two_pass)")
    gradient_reads = 1

    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        return MethodState(largest_tensor_numel(model, shape)[1] * precision.grad_bytes, 0)

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        """The update inside backward, and with clip_mode two_pass a whole forward +
        backward more."""
        numel = sum(local_param_numel(model, shape).values())
        update_s = numel * (2 * precision.param_bytes
                            + self.gradient_reads * precision.grad_bytes) / rates.bytes_per_s
        options = cast(FusedBackwardOptions, train.options())
        passes = 2 if options.clip_mode == "two_pass" else 1
        return MethodCost(0, passes, update_s)


class AdaLomoModel(LOMOModel):
    """AdaLomo: a row and a column statistic per matrix, a second moment per vector; it reads
    each gradient also for those statistics and for the update's norm."""

    time_note = ("step time: forward + backward with adalomo's update inside it (twice with "
                 "clip_mode two_pass)")
    gradient_reads = 3

    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        factored = sum(rl + cl for _, _, rl, cl in local_matrices(model, shape))
        state_bytes = precision.optimizer_bytes // 2  # one float32 state tensor per element
        return MethodState(super().state(model, shape, train, precision).grads,
                           (factored + local_vector_numel(model, shape)) * state_bytes)

    def collectives(self, model: ModelConfig, shape: GridShape, train: TrainConfig
                    ) -> list[Collective]:
        """Per matrix its row sums of g^2 all-reduced over the axes that split the columns
        and its column sums over those that split the rows, the mean of its row means, and
        per tensor the two sums of squares of its RMS terms."""
        out: list[Collective] = []
        for m, n, rows, cols in matrix_layouts(model):
            out += on_axes(shape, cols, "all_reduce", m // axes_parts(rows, shape) * 4)
            out += on_axes(shape, rows, "all_reduce", n // axes_parts(cols, shape) * 4)
            out += on_axes(shape, rows, "all_reduce", 4)  # the mean of the row means
            out += on_axes(shape, rows + cols, "all_reduce", 8)  # sums of squares of u, w
        for axes in vector_layouts(model):
            out += on_axes(shape, axes, "all_reduce", 8)
        return out


LOMO = LOMOModel()
ADALOMO = AdaLomoModel()
