"""All four axes at once: data 2 x z 2 x y 2 x x 2 (16 gloo ranks) trains the model that one
process trains, every rank's ledger is what torch.distributed was handed and what the planner
predicts, and its checkpoint resumes on 8 ranks of another shape; parallel.auto picks a grid
for 16 ranks and every rank builds it.

Sized for a 2-core host: one thread per rank, the smallest model that every axis of both grids
still splits (four heads over two key-value heads, each dimension divisible by the axes that
split it), and two jobs (16 ranks, then 8) that check everything between them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fourfold.config import load_config
from fourfold.plan import choose_grid
from fourfold.plan.perf import Overlap
from fourfold.plan.search import grid_problem

from grid_cases import launch_grid_cases
from test_parallel import STEPS, check_against_one_process

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

WORKER = Path(__file__).with_name("four_axes_worker.py")

FOUR_AXES = [2, 2, 2, 2]  # (data, z, y, x)
RESUME_GRID = [1, 4, 1, 2]  # 8 ranks: z deeper, y and data gone: every block changes
# x * z = 8 splits dim, y * z = 4 splits ffn_dim, the kv dim (2 x 8) and the vocabulary
TINY = {"n_layers": 2, "dim": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
        "vocab_size": 64, "max_seq_len": 32}
VARIANT = {"model": TINY, "bias": True, "accum": 2}  # every kind of parameter, micro-steps
MORE_STEPS = 2
# parallel.auto on a preset machine (a "cpu" machine would probe 16 more gloo ranks first); a
# batch of 4 leaves no 16-rank grid of data alone, so the planner weighs the tensor axes
AUTO = ["model.preset=debug", "model.n_layers=1", "model.dim=32", "model.n_heads=4",
        "model.n_kv_heads=2", "model.ffn_dim=64", "train.batch_size=4", "train.seq_len=16",
        "train.device=cpu", "parallel.auto=true", "parallel.machine=dgx-h100"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, fourfold_cache: Path) -> dict:
    from fourfold.data import resolve_data_path

    resolve_data_path("builtin:stdlib", "byte")  # prepared once, before the ranks start
    root = tmp_path_factory.mktemp("four_axes")
    env = {"FOURFOLD_TEST_RUN": str(root / "run")}
    sixteen = launch_grid_cases(
        WORKER, 16, [FOUR_AXES], "FOURFOLD_TEST_CHECKS", "check",
        [{"name": "train", "variant": VARIANT}, {"name": "auto", "overrides": AUTO}],
        root / "sixteen.jsonl", env=env)
    eight = launch_grid_cases(
        WORKER, 8, [RESUME_GRID], "FOURFOLD_TEST_CHECKS", "check",
        [{"name": "resume", "variant": VARIANT, "more_steps": MORE_STEPS}],
        root / "eight.jsonl", env=env)
    return {"train": [r for r in sixteen if r["check"]["name"] == "train"],
            "auto": [r for r in sixteen if r["check"]["name"] == "auto"], "resume": eight}


def test_four_axes_on_sixteen_ranks(jobs: dict) -> None:
    """Losses within 1e-5 and weights after three SGD steps within 1e-5 of one process, on
    every rank its ledger equal to the count of what torch.distributed was handed and to the
    planner's bytes, its parameter, gradient and momentum bytes the memory model's."""
    assert [r["rank"] for r in jobs["train"]] == list(range(16))
    for r in jobs["train"]:
        check_against_one_process({**r, "variant": r["check"]["variant"]})


def test_resumed_on_eight_ranks_of_another_shape(jobs: dict) -> None:
    assert [r["rank"] for r in jobs["resume"]] == list(range(8))
    for r in jobs["resume"]:
        label = f"rank {r['rank']}"
        assert r["saved_step"] == STEPS, label
        assert r["loaded_diff"] == 0.0, f"{label}: the loaded weights are not the saved ones"
        # the momentum came along: two more steps as one process's steps 4 and 5
        check_against_one_process({**r, "variant": r["check"]["variant"]}, steps=MORE_STEPS)


def test_parallel_auto_picks_a_sixteen_rank_grid(jobs: dict) -> None:
    """Rank 0's planner chose, every rank built that grid and recorded it in the run's config:
    the grid this process's planner picks for the same config (the fastest that fits)."""
    cfg = load_config(None, AUTO)
    t, p = cfg.train, cfg.parallel
    overlap = Overlap(**{f.name: getattr(p, f.name) for f in dataclasses.fields(Overlap)})
    expected, _ = choose_grid(cfg.model, 16, p.machine, t.batch_size, t.seq_len, dtype=t.dtype,
                              overlap=overlap, activation_checkpointing=t.activation_checkpointing,
                              grad_accum=t.grad_accum, reduce_dtype=p.reduce_dtype, train=t)
    assert grid_problem(cfg.model, expected, t.batch_size) is None
    assert expected.data < 16  # the batch of 4 cannot be split 16 ways
    assert [r["rank"] for r in jobs["auto"]] == list(range(16))
    for r in jobs["auto"]:
        assert r["built"] == r["recorded"] == [expected.data, expected.z, expected.y, expected.x], \
            f"rank {r['rank']}: {r}"
