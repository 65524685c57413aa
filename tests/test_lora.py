"""LoRA and norm tuning: every grid trains the same adapter as one process (see lora_worker.py),
the [adapter] config's bad input, and the Hugging Face side (peft files, merged checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("lora_worker.py")

ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down", "output"]
VARIANTS = [
    {"kind": "lora"},
    # SGD here: AdamW divides tiny gradients by their own size and magnifies float noise
    {"kind": "lora", "targets": ALL_TARGETS, "train_norms": True, "bias": True, "accum": 2,
     "r": 4, "alpha": 8.0, "opt": "sgd"},
    {"kind": "lora", "hf": True, "ckpt": True},
    {"kind": "norm", "train_output": True, "tie": True},
    {"kind": "lora", "dropout": 0.2, "ckpt": True},  # replicas agree; no one-process twin
]

GRIDS = {  # (data, z, y, x)
    2: [[1, 1, 1, 2], [1, 1, 2, 1], [1, 2, 1, 1], [2, 1, 1, 1]],
    4: [[1, 1, 2, 2], [2, 2, 1, 1], [1, 2, 1, 2], [2, 1, 2, 1]],
}


def run_worker(nproc: int, grids: list, variants: list, tmp_path: Path) -> list[dict]:
    out = tmp_path / f"lora_{nproc}.jsonl"
    env = dict(os.environ, FOURFOLD_TEST_SHAPES=json.dumps(grids),
               FOURFOLD_TEST_VARIANTS=json.dumps(variants), FOURFOLD_TEST_OUT=str(out),
               OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone", str(WORKER)],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.ranks
@pytest.mark.parametrize("nproc", [2, 4])
def test_adapters_train_the_same_on_every_grid(nproc: int, tmp_path: Path) -> None:
    results = run_worker(nproc, GRIDS[nproc], VARIANTS, tmp_path)
    assert len(results) == len(GRIDS[nproc]) * len(VARIANTS)
    for r in results:
        label = f"grid {r['shape']} variant {r['variant']}"
        assert r["ok"], f"{label}:\n{r.get('error')}"
        assert r["same_trainable"] and r["n_trainable"] > 0, label
        assert r["max_frozen_change"] == 0.0, f"{label}: the frozen base moved"
        assert r["replica_spread"] == 0.0, f"{label}: replicas differ by {r['replica_spread']}"
        data, z, y, x = r["shape"]
        for axis, size in (("x", x), ("y", y), ("z", z), ("data", data)):
            assert (r["ledger"][axis] > 0) == (size > 1), f"{label}: ledger {r['ledger']}"
        if r["variant"].get("dropout"):
            continue  # masks are keyed by grid position: not the one-process masks
        assert r["init_diff"] == 0.0, f"{label}: the adapter starts differently"
        assert r["max_loss_diff"] < 1e-5, f"{label}: losses {r['losses']} vs {r['ref_losses']}"
        tol = 1e-5 if r["variant"].get("opt") == "sgd" else 1e-4
        assert r["max_adapter_diff"] < tol, \
            f"{label}: {r['worst_adapter']} differs by {r['max_adapter_diff']}"
        assert r["loss_drop"] > 0.05, f"{label}: did not learn: {r['ref_losses']}"
        assert r["adapter_moved"] > 1e-3, label
