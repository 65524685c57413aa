"""The planner's activation-memory model against measurement: the bytes autograd saves for
backward on every rank of 1, 2, 4 and 8-rank gloo grids, with and without activation
checkpointing (see memory_worker.py for what is measured). Parameters, gradients and AdamW
states are checked exactly in test_parallel.py."""

from __future__ import annotations

import sys
from pathlib import Path

import memory_worker
import pytest

pytestmark = pytest.mark.ranks

TOLERANCE = 0.15
# A whole training rank's peak resident memory (VmHWM) is the heap's peak in use plus what the
# heap could not reuse, which depends on when gloo's threads allocate: on the 15m preset at
# z = 2 the heap's peak in use is the same in every run (160 MiB above the import, sampled),
# while VmHWM above the import read 188-207 MiB on one machine and 225 on another (predicted
# 191). The tensors are checked to 15% above and in test_parallel.py; the whole rank to 25%.
RANK_TOLERANCE = 0.25

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc, /proc")
def test_a_training_rank_peak_is_what_the_rank_model_predicts(tmp_path: Path) -> None:
    """Two steps, a checkpoint and the streamed export of the 15m preset on z = 2: each rank's
    peak resident memory above the import matches predict_memory, runtime term included. With
    a heap that kept freed blocks without letting them coalesce this read 40% over."""
    import rank_memory_worker

    from fourfold.config import load_config
    from fourfold.parallel import GridShape
    from fourfold.plan.memory import Precision, predict_memory

    cfg = load_config(None, ["model.preset=15m", "train.steps=2", "train.batch_size=8",
                             "train.seq_len=64", "train.eval_batches=0", "train.sample_tokens=0",
                             "checkpoint.every=1", "checkpoint.keep=1", "checkpoint.async=false",
                             "parallel.z=2", "parallel.data=1"])
    cfg_path = tmp_path / "config.toml"
    cfg.save(cfg_path)
    results, stderr = rank_memory_worker.launch(
        2, "train", tmp_path / "mem.jsonl",
        {"FOURFOLD_RANK_MEM_CONFIG": str(cfg_path), "FOURFOLD_RANK_MEM_RUN": str(tmp_path / "run"),
         "FOURFOLD_RANK_MEM_PHASES": "1"},
        timeout_s=600)
    assert results is not None, stderr[-4000:]
    shape = GridShape(data=1, z=2, y=1, x=1)
    for r in results:
        predicted = predict_memory(cfg.model, shape, 4 * 64, False, Precision.of("float32"),
                                   on_host=True, writer=r["rank"] == 0, checkpoints=True).total
        measured = r["peak"] - r["baseline"]
        phases = "; ".join(f"{name} rss {rss >> 20} heap {used >> 20} MiB"
                           for name, rss, _, used, *_ in r["phases"])
        assert abs(predicted - measured) <= RANK_TOLERANCE * measured, \
            f"rank {r['rank']}: measured {measured} B, predicted {predicted} B; {phases}"
