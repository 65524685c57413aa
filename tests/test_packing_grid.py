"""Packed chat data on grids of 2 and 4 ranks against one process (packing_worker.py): every
document's logits inside the packed rows equal its logits alone; the masked loss and the
weights after three steps with gradient accumulation and balanced shards equal one process's
with the whole batch at once. And the trainer itself: `fourfold train` on chat data with
data = 2 and grad_accum = 2 against one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import outside_job_env
from test_packing import prepare_chats
from grid_cases import launch_grid_cases

pytestmark = pytest.mark.ranks

WORKER = Path(__file__).with_name("packing_worker.py")
GRIDS = {  # (data, z, y, x)
    2: [[1, 1, 1, 2], [1, 1, 2, 1], [1, 2, 1, 1], [2, 1, 1, 1]],
    4: [[1, 1, 2, 2], [2, 2, 1, 1], [1, 2, 1, 2], [4, 1, 1, 1]],
}
CASES = [{"kind": "logits"}, {"kind": "logits", "bias": True, "tie": True},
         {"kind": "train", "accum": 2}, {"kind": "train", "accum": 2, "ckpt": True}]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    return prepare_chats(tmp_path_factory.mktemp("chat"), 200, seed=9)


@pytest.mark.parametrize("nproc", [2, 4])
def test_packed_documents_on_every_grid_match_one_process(nproc, chat_data, tmp_path):
    # every rank reports every (grid, case), checked by launch_grid_cases, and each is checked
    results = launch_grid_cases(WORKER, nproc, GRIDS[nproc], "FOURFOLD_TEST_CASES", "case", CASES,
                                tmp_path / "results.jsonl",
                                env={"FOURFOLD_TEST_DATA": str(chat_data)})
    for r in results:
        label = f"grid {r['shape']} case {r['case']} rank {r['rank']}"
        if r["case"]["kind"] == "logits":
            assert r["shared_rows"] > 0, label  # the rank had rows holding several documents
            assert r["max_logit_diff"] < 1e-5, f"{label}: {r['max_logit_diff']}"
        else:
            assert r["max_rel_loss"] < 1e-5, f"{label}: {r['losses']} vs {r['ref_losses']}"
            assert r["max_weight_diff"] < 1e-5, f"{label}: {r['max_weight_diff']}"
            assert len(set(r["trained_counts"])) > 1  # steps with different trained counts


@pytest.mark.usefixtures("one_thread")
def test_the_trainer_on_two_data_ranks_matches_one_process(chat_data, tmp_path, monkeypatch):
    from fourfold.config import load_config
    from fourfold.train import train
    from fourfold.train.metrics import read_metrics

    overrides = ["model.preset=debug", f"data.path={chat_data}", "train.batch_size=8",
                 "train.seq_len=64", "train.steps=3", "train.warmup_steps=1",
                 "train.grad_accum=2", "train.eval_every=3", "train.eval_batches=1",
                 "train.sample_tokens=0", "train.log_every=1"]
    env = outside_job_env(FOURFOLD_CACHE=str(tmp_path / "cache"))
    sets = [arg for item in [*overrides, "parallel.data=2"] for arg in ("--set", item)]
    launch = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "fourfold", "train", *sets, "--out", str(tmp_path / "grid")],
        env=env, capture_output=True, text=True, timeout=300)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    monkeypatch.setenv("FOURFOLD_CACHE", env["FOURFOLD_CACHE"])
    single = train(load_config(None, [*overrides, "train.grad_accum=1"]), tmp_path / "single",
                   progress=False)
    records = read_metrics(tmp_path / "grid" / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single.losses), rtol=1e-5,
                               atol=0)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    torch.testing.assert_close(torch.tensor(val[-1]), torch.tensor(single.val_loss), rtol=1e-5,
                               atol=0)
