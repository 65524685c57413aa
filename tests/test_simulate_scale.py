"""The planner against the real code of a rank at full scale: rank 0 and the last rank of the
`70b` preset on 1,024 ranks and of `405b` on 16,384, each on the grid the planner chooses,
built and stepped under the fake process group and fake tensors (fourfold.simulate). Each
rank starts as a resumed run does (its AdamW state made before the first step), so that one
step holds what every step of a run holds: its peak is a later step's (bench/simulate.py runs
two fresh steps and reads the same peak)."""

from __future__ import annotations

import dataclasses

import pytest

from fourfold.config import Config, model_config
from fourfold.parallel.grid import AXES, GridShape
from fourfold.plan import choose_grid
from fourfold.plan.machine_file import load_machine
from fourfold.simulate import (RankReport, first_trace_difference, planner_tensor_bytes,
                               simulate)

pytestmark = pytest.mark.slow

SEQ = 8192
# (model, ranks, global batch in sequences): bench/simulate.py's cases
CASES = [("70b", 1024, 128), ("405b", 16384, 1024)]
TOLERANCE = 0.03


def scale_config(model: str, batch: int) -> Config:
    cfg = Config()
    cfg.model = model_config(model)
    cfg.train = dataclasses.replace(cfg.train, batch_size=batch, seq_len=SEQ, dtype="bfloat16",
                                    activation_checkpointing=True)
    return cfg


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{w}" for m, w, _ in CASES])
def simulated(request: pytest.FixtureRequest) -> tuple[GridShape, list[RankReport]]:
    model, world, batch = request.param
    cfg, machine = scale_config(model, batch), load_machine("dgx-h100")
    shape, _ = choose_grid(cfg.model, world, machine, batch, SEQ, dtype="bfloat16",
                           activation_checkpointing=True)
    return shape, simulate(cfg, shape, [0, shape.size - 1], machine, steps=1, resumed=True,
                           whole_run=False)


def test_bytes_per_axis_are_the_planners(simulated: tuple[GridShape, list[RankReport]]) -> None:
    shape, reports = simulated
    for r in reports:
        assert {a: r.step_bytes.get(a, 0) for a in AXES} == r.planned_bytes, (shape, r.rank)
        assert sum(r.planned_bytes.values()) > 0


def test_planner_tensor_terms_are_within_3_percent_of_the_peak(
        simulated: tuple[GridShape, list[RankReport]]) -> None:
    """Every term of the planner's but the host runtime (none on a GPU) against the peak of
    live tensors; the state made before the step is in every phase after the build."""
    shape, reports = simulated
    for r in reports:
        assert r.planned_memory is not None
        planned = planner_tensor_bytes(r.planned_memory)
        assert abs(planned / r.peak - 1) < TOLERANCE, (shape, r.rank, planned, r.peaks)
        # the peak is the step's (the saved activations), not the state's update
        assert r.peak == max(r.peaks["forward"], r.peaks["backward"]) > r.peaks["optimizer"]


def test_the_ranks_issue_the_same_collectives(
        simulated: tuple[GridShape, list[RankReport]]) -> None:
    """Rank 0 and the last rank share only the whole world's group, where their traces must
    be equal; on each axis they are in different groups of the same size, which run the same
    program: their traces on it are equal too (operation, dtype, shape)."""
    shape, (first, last) = simulated
    assert first_trace_difference(shape, [first, last]) is None
    for axis in AXES:
        ours = [(c.op, c.dtype, c.shape) for c in first.trace if c.axis == axis]
        theirs = [(c.op, c.dtype, c.shape) for c in last.trace if c.axis == axis]
        assert ours == theirs, axis
        assert ours or getattr(shape, axis) == 1, axis
