"""Memory-lean training: frozen parameters cost nothing on a grid, and every method in
train/methods trains on a grid as on one process (see lean_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import outside_job_env

WORKER = Path(__file__).with_name("lean_worker.py")


def run_worker(nproc: int, grids: list, checks: list, tmp_path: Path) -> list[dict]:
    out = tmp_path / f"lean_{nproc}.jsonl"
    env = outside_job_env(FOURFOLD_TEST_SHAPES=json.dumps(grids),
                          FOURFOLD_TEST_CHECKS=json.dumps(checks), FOURFOLD_TEST_OUT=str(out),
                          OMP_NUM_THREADS="1", PYTHONPATH=str(WORKER.parent))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone", str(WORKER)],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == len(grids) * len(checks)
    for r in results:
        assert r["ok"], f"grid {r['shape']} check {r['check']}:\n{r.get('error')}"
    return results


def check_frozen(r: dict) -> None:
    label = f"grid {r['shape']} frozen"
    assert r["frozen_with_grad"] == [], label
    assert r["unchanged"], label
    assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref_losses"])) < 1e-5, label
    assert r["max_weight_diff"] < 1e-5, label
    assert r["ledger_delta"] == r["expected_delta"], label
    full, frozen = r["saved_bytes"]
    assert frozen < full, f"{label}: saved {frozen} bytes frozen vs {full}"


def test_frozen_parameters_cost_nothing_on_grids(tmp_path: Path) -> None:
    grids = [[1, 2, 1, 1], [2, 1, 1, 1], [1, 1, 2, 1], [1, 1, 1, 2]]
    for r in run_worker(2, grids, [{"name": "frozen"}], tmp_path):
        check_frozen(r)
