"""The planner's activation-memory model against measurement: the bytes autograd saves for
backward on every rank of 1, 2, 4 and 8-rank gloo grids, with and without activation
checkpointing (see memory_worker.py for what is measured). Parameters, gradients and AdamW
states are checked exactly in test_parallel.py."""

from __future__ import annotations

from pathlib import Path

import memory_worker
import pytest

pytestmark = pytest.mark.ranks

TOLERANCE = 0.15

GRIDS = {  # (data, z, y, x); the debug model has 2 kv heads, so y is at most 2
    1: [[1, 1, 1, 1]],
    2: [[1, 1, 1, 2], [1, 1, 2, 1], [1, 2, 1, 1], [2, 1, 1, 1]],
    4: [[1, 1, 2, 2], [1, 2, 1, 2], [2, 2, 1, 1]],
    8: [[1, 2, 2, 2], [2, 1, 2, 2]],
}


def run_memory_worker(nproc: int, grids: list, out: Path) -> list[dict]:
    results, stderr = memory_worker.launch(nproc, grids, out, timeout_s=300)
    assert results is not None, stderr[-4000:]
    return results


@pytest.mark.parametrize("nproc", sorted(GRIDS))
def test_activation_memory_within_tolerance(nproc: int, tmp_path: Path) -> None:
    results = run_memory_worker(nproc, GRIDS[nproc], tmp_path / "memory.jsonl")
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    # every grid, both checkpointing settings, every rank
    assert len(results) == len(GRIDS[nproc]) * 2 * nproc
    assert {r["ckpt"] for r in results} == {False, True}
    for r in results:
        label = f"grid {r['shape']} ckpt={r['ckpt']} rank {r['rank']}"
        assert r["measured"] > 0, label
        error = abs(r["predicted"] - r["measured"]) / r["measured"]
        assert error <= TOLERANCE, (f"{label}: predicted {r['predicted']} B, measured "
                                    f"{r['measured']} B ({error:.1%}); phases {r['phases']}")
    by_grid = {(tuple(r["shape"]), r["rank"], r["ckpt"]): r["measured"] for r in results}
    for (shape, rank, ckpt), measured in by_grid.items():
        if not ckpt:  # checkpointing must save memory, else the measurement is not seeing it
            assert by_grid[(shape, rank, True)] < measured, f"grid {list(shape)} rank {rank}"
