"""The trainer on two gloo ranks (data = 2, grad_accum = 2) against one process: the same
losses, validation losses and final weights, from one torchrun launch.

Run as a script, this file is the rank worker: `torchrun ... test_train_multirank.py RUN_DIR
--set ...`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

OVERRIDES = ["model.preset=debug", "train.batch_size=8", "train.seq_len=64", "train.steps=4",
             "train.warmup_steps=2", "train.grad_accum=2", "train.eval_every=2",
             "train.eval_batches=2", "train.sample_tokens=8", "train.log_every=1"]


@pytest.mark.usefixtures("one_thread")  # as each rank has: tiny models only lose with more
def test_two_data_ranks_match_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    from safetensors.torch import load_file

    from fourfold.config import load_config
    from fourfold.train import train
    from fourfold.train.metrics import read_metrics

    env = {**os.environ, "FOURFOLD_CACHE": str(tmp_path / "cache")}
    grid_dir = tmp_path / "grid"
    launch = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         __file__, str(grid_dir), *OVERRIDES, "parallel.data=2"],
        env=env, capture_output=True, text=True, timeout=300)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]

    monkeypatch.setenv("FOURFOLD_CACHE", env["FOURFOLD_CACHE"])
    single = train(load_config(None, OVERRIDES), tmp_path / "single", progress=False)

    summary = json.loads((grid_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["grid"] == "data=2 z=1 y=1 x=1"
    records = read_metrics(grid_dir / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single.losses), rtol=1e-5,
                               atol=0)
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert [s for s, _ in val] == [s for s, _ in single.val_losses] == [0, 2, 4]
    torch.testing.assert_close(torch.tensor([v for _, v in val]),
                               torch.tensor([v for _, v in single.val_losses]), rtol=1e-5, atol=0)
    assert all(r["comm_bytes_data"] > 0 for r in records if "loss" in r)
    grid_weights = load_file(str(grid_dir / "model.safetensors"))
    single_weights = load_file(str(tmp_path / "single" / "model.safetensors"))
    assert grid_weights.keys() == single_weights.keys()
    for name, value in single_weights.items():
        torch.testing.assert_close(grid_weights[name], value, rtol=0, atol=2e-5, msg=name)
    assert summary["sample"]  # rank 0 sampled from the gathered weights


def _rank_main(run_dir: str, overrides: list[str]) -> int:
    import torch.distributed as dist

    from fourfold.config import load_config
    from fourfold.train import train

    code = 0
    try:
        train(load_config(None, overrides), Path(run_dir), progress=False)
    except Exception:  # noqa: BLE001 - report any failure through the exit code
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(code)  # gloo can abort at interpreter exit after destroy_process_group


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2:])
