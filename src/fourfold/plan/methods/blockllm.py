"""BlockLLM's planner model: AdamW's gradients and moments of the selected rows, and a step
that selects (an upper bound: at patience 1, the default, most steps select)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

from fourfold.config import ModelConfig, TrainConfig
from fourfold.methods.blockllm import HOLD_SLACK, BlockLLMOptions
from fourfold.methods.zeroth import ACCELERATOR_NOISE_CHUNK_ELEMENTS
from fourfold.parallel.grid import GridShape
from fourfold.plan.memory import (Precision, largest_tensor_numel, local_vector_numel,
                                  matrix_layouts, vector_layouts)
from fourfold.plan.methods.adamw import adamw_update_seconds
from fourfold.plan.methods.base import MethodCost, MethodModel, MethodState
from fourfold.plan.perf import Rates
from fourfold.plan.schedule import Collective, block_linears, local_param_numel

# The row norms at a selection (blockllm.row_norms_sq): each gradient read in chunks, widened
# to float64, squared and summed by row, a CPU's 1 MiB chunks staying in cache (19 copy-bytes
# an element); on GPUs its chunks are the noise's, ~4 launches each.
ROW_NORM_BYTES_PER_ELEMENT = 20
ROW_NORM_OPS_PER_CHUNK = 4
# The streamed choice (blockllm.choose_rows) on the host, each time the held rows outgrow the
# budget by HOLD_SLACK and once at the end over every row: per call, per tensor and per row
# ranked, timed on a 2-core CPU host
CHOOSE_S_PER_CALL = 1.5e-4
CHOOSE_S_PER_TENSOR = 7e-6
CHOOSE_S_PER_ROW = 1.5e-7
# ... its gathers of rows: after the first ranking a tensor's rows at or above the floor (the
# steepest row a ranking dropped) are gathered at its hand-off, CHOICE_FLOOR_PASS of its
# elements; each ranking gathers the kept rows of the held tensors that lost some,
# CHOICE_COPIED_SHARE of the budget; gathers run at CHOICE_GATHER_RATE of the copy rate
# (cold rows into new blocks).
CHOICE_FLOOR_PASS = 0.4
CHOICE_COPIED_SHARE = 0.55
CHOICE_GATHER_RATE = 0.22


@dataclass(frozen=True)
class ChoiceWork:
    """BlockLLM's choice in one selection, as `blockllm_choice_work` models it."""

    rankings: int  # choose_rows calls
    tensors: int  # tensors those calls ranked, summed over them
    rows: float  # rows they ranked, summed
    gathered: float  # elements gathered (float32), over all ranks of a tensor


def tensor_rows(model: ModelConfig) -> list[tuple[int, int]]:
    """(full rows, row size) of every parameter tensor in forward order, as BlockLLM sees its
    blocks: a matrix's rows, a vector (a norm's gain, a bias) as one row."""
    out = [(model.vocab_size, model.dim)]
    for _ in range(model.n_layers):
        for lin in block_linears(model):
            if lin.name in ("q", "gate"):  # the attention's and the ffn's norm before them
                out.append((1, model.dim))
            out.append((lin.out_features, lin.in_features))
            if model.bias:
                out.append((1, lin.out_features))
    out.append((1, model.dim))
    if not model.tie_embeddings:
        out.append((model.vocab_size, model.dim))
    return out


def blockllm_choice_work(model: ModelConfig, sparsity: float) -> ChoiceWork:
    """BlockLLM's streamed choice in one selection (blockllm.BlockLLM._on_grad_ready): in
    backward order each tensor's gradient is held (whole until the first ranking, then its
    rows at or above the floor: CHOICE_FLOOR_PASS of them, gathered) until the held elements
    exceed the budget ((1 - sparsity) of them) by HOLD_SLACK of all; then the held rows are
    ranked (full rows: the same on every rank) and the held gradients cut to the budget
    (CHOICE_COPIED_SHARE of it gathered; rows kept in proportion to elements); at the end
    every row is ranked once more and the held gradients cut again."""
    forward = tensor_rows(model)
    total = sum(rows * size for rows, size in forward)
    budget = (1.0 - sparsity) * total
    limit = budget + HOLD_SLACK * total
    rankings, tensors, ranked, gathered = 0, 0, 0.0, 0.0
    held_rows, held_elements, held_tensors, share = 0.0, 0.0, 0, 1.0
    for rows, size in reversed(forward):
        if share < 1.0:
            gathered += share * rows * size
        held_rows += share * rows
        held_elements += share * rows * size
        held_tensors += 1
        if held_elements > limit:
            rankings, tensors, ranked = rankings + 1, tensors + held_tensors, ranked + held_rows
            gathered += CHOICE_COPIED_SHARE * budget
            held_rows *= budget / held_elements
            held_elements, share = budget, CHOICE_FLOOR_PASS
    return ChoiceWork(rankings + 1, tensors + len(forward),
                      ranked + sum(rows for rows, _ in forward),
                      gathered + CHOICE_COPIED_SHARE * budget)


def blockllm_choice_seconds(model: ModelConfig, sparsity: float, bytes_per_s: float,
                            shards: int = 1) -> float:
    """BlockLLM's choice in one selection, in seconds (`blockllm_choice_work`): its rankings on
    the host and its gathers of rows (float32, read and written, at CHOICE_GATHER_RATE of
    `bytes_per_s`, split over the `shards` ranks that split each tensor)."""
    work = blockllm_choice_work(model, sparsity)
    return CHOOSE_S_PER_CALL * work.rankings + CHOOSE_S_PER_TENSOR * work.tensors \
        + CHOOSE_S_PER_ROW * work.rows \
        + 8 * work.gathered / shards / (CHOICE_GATHER_RATE * bytes_per_s)


class BlockLLMModel(MethodModel):
    time_note = ("step time: a selection every step, an upper bound: AdamW's backward with "
                 "every dW GEMM, every gradient's row norms (all-reduced over the tensor axes "
                 "at each hand-off), the streamed choice's rankings of held rows on the host "
                 "and gathers of the kept ones, and the selected rows' update")

    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        """Moments and gradients of the selected (1 - sparsity) share of the rows, a step
        count per row; a selection step's backward holds up to HOLD_SLACK of the elements more
        before it ranks them, and the tensor being handed off (the largest block) and the
        vectors (with grad_accum > 1 every gradient lives until the last micro-step)."""
        numel = sum(local_param_numel(model, shape).values())
        sparsity = cast(BlockLLMOptions, train.options()).sparsity
        selected = int(numel * (1.0 - sparsity))
        handed_off = largest_tensor_numel(model, shape)[1] + local_vector_numel(model, shape)
        held = selected + int(numel * HOLD_SLACK)  # held rows before a ranking
        grads = numel if train.grad_accum > 1 else min(numel, held + handed_off)
        rows = math.ceil(selected / model.dim)  # a float32 step count per chosen row
        return MethodState(grads * precision.grad_bytes,
                           selected * precision.optimizer_bytes + 4 * rows)

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        """A selection every step: AdamW's backward (every candidate trainable), each
        gradient's row norms in float64, AdamW's update on the selected share and the
        choice's work at each hand-off (`blockllm_choice_seconds`)."""
        numel = sum(local_param_numel(model, shape).values())
        tensors = len(matrix_layouts(model)) + len(vector_layouts(model))
        sparsity = cast(BlockLLMOptions, train.options()).sparsity
        norms_s = max(numel * ROW_NORM_BYTES_PER_ELEMENT / rates.bytes_per_s,
                      (numel / ACCELERATOR_NOISE_CHUNK_ELEMENTS + tensors)
                      * ROW_NORM_OPS_PER_CHUNK * rates.op_overhead_s)
        return MethodCost(0, 1, (1.0 - sparsity) * adamw_update_seconds(numel, rates, precision)
                          + norms_s + blockllm_choice_seconds(model, sparsity, rates.bytes_per_s,
                                                              shape.x * shape.y * shape.z))

    def collectives(self, model: ModelConfig, shape: GridShape, train: TrainConfig
                    ) -> list[Collective]:
        """A selection every step: per tensor its full rows' norms (float64) all-reduced over
        the tensor group (x, y and z together, booked on the innermost of them that splits),
        each blocking the backward at its hand-off."""
        axis = next((a for a in ("x", "y", "z") if getattr(shape, a) > 1), None)
        if axis is None:
            return []
        rows = [m for m, _ in tensor_rows(model)]
        return [Collective(axis, "all_reduce", 8 * m, rows.count(m), "step_method",
                           group_size=shape.x * shape.y * shape.z) for m in sorted(set(rows))]


BLOCKLLM = BlockLLMModel()
