"""MeZO's and ES's planner model: forwards alone, no gradient and no state, and passes of
seeded noise over every weight (train/methods/zeroth.py)."""

from __future__ import annotations

from typing import cast

from fourfold.config import ModelConfig, TrainConfig
from fourfold.methods.zeroth import ACCELERATOR_NOISE_CHUNK_ELEMENTS, ESOptions
from fourfold.parallel.grid import GridShape
from fourfold.plan.memory import Precision, matrix_layouts, vector_layouts
from fourfold.plan.methods.base import MethodCost, MethodModel, MethodState
from fourfold.plan.perf import Rates
from fourfold.plan.schedule import local_param_numel

# The noise is made in chunks by about NOISE_OPS_PER_CHUNK element-wise ops (the int32 hash of
# each coordinate, Box-Muller, the scale and the add into the weight). The cpu machine's probe
# times the generator itself (`noise_s_per_element`); on a GPU each op reads and writes 4-byte
# elements at memory bandwidth or costs its launch, whichever is more: a model, never measured
# on a GPU.
NOISE_OPS_PER_CHUNK = 45
NOISE_BYTES_PER_ELEMENT = 8 * NOISE_OPS_PER_CHUNK


def noise_seconds(model: ModelConfig, shape: GridShape, rates: Rates) -> float:
    """One pass of seeded noise over every local weight."""
    numel = sum(local_param_numel(model, shape).values())
    if rates.noise_s_per_element > 0.0:
        return numel * rates.noise_s_per_element
    tensors = len(matrix_layouts(model)) + len(vector_layouts(model))
    chunks = numel / ACCELERATOR_NOISE_CHUNK_ELEMENTS + tensors
    return max(numel * NOISE_BYTES_PER_ELEMENT / rates.elementwise_bytes_per_s,
               chunks * NOISE_OPS_PER_CHUNK * rates.op_overhead_s)


class ForwardOnlyModel(MethodModel):
    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        return MethodState(0, 0)


class MeZOModel(ForwardOnlyModel):
    time_note = ("step time: mezo's two forwards and three noise passes (the noise's cost is "
                 "probed on the cpu machine, modelled on GPUs)")

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        """Two forwards and three noise passes (+eps, -2 eps, then back and the update in
        one)."""
        return MethodCost(2, 1, 3 * noise_seconds(model, shape, rates))


class ESModel(ForwardOnlyModel):
    time_note = ("step time: es's forwards (population / data per replica) and its noise "
                 "passes: 2 per member, or 3 per antithetic pair, and one per direction (the "
                 "noise's cost is probed on the cpu machine, modelled on GPUs)")

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        """The members a data replica evaluates (ceil(population / data)) and the noise
        passes every rank makes: it perturbs and restores every member (two passes a member;
        a mirrored pair three, +sigma, -2 sigma and back), then rebuilds the update from every
        direction's seed (one pass per direction: per member, or per antithetic pair)."""
        options = cast(ESOptions, train.options())
        members = -(-options.population // shape.data)
        visits = 3 * options.directions if options.antithetic else 2 * options.population
        passes = visits + options.directions
        return MethodCost(members, 1, passes * noise_seconds(model, shape, rates))


MEZO = MeZOModel()
ES = ESModel()
