"""The trainer on two gloo ranks against one process, launched the way users start it:
`torchrun --nproc-per-node 2 -m fourfold train ...` (test_launch covers `--nproc`). Data = 2 with
grad_accum = 2: the same losses, validation losses and final weights; x = 2 under
train.compile: the same losses as one uncompiled process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import outside_job_env

OVERRIDES = ["model.preset=debug", "train.batch_size=8", "train.seq_len=64", "train.steps=4",
             "train.warmup_steps=2", "train.grad_accum=2", "train.eval_every=2",
             "train.eval_batches=2", "train.sample_tokens=8", "train.log_every=1"]


def torchrun_train(items: list[str], out: Path, env: dict[str, str]
                   ) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m fourfold train --set ITEM ... --out OUT`, checked."""
    sets = [arg for item in items for arg in ("--set", item)]
    launch = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "fourfold", "train", *sets, "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    return launch


@pytest.mark.ranks
@pytest.mark.usefixtures("one_thread")  # as each rank has: tiny models only lose with more
def test_two_data_ranks_match_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    from safetensors.torch import load_file

    from fourfold.config import load_config
    from fourfold.train import train
    from fourfold.train.metrics import read_metrics

    env = outside_job_env(FOURFOLD_CACHE=str(tmp_path / "cache"))
    grid_dir = tmp_path / "grid"
    launch = torchrun_train([*OVERRIDES, "parallel.data=2"], grid_dir, env)
    assert launch.stdout.count("run files:") == 1  # rank 0 only

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
    assert summary["sample"]  # sampled on the grid (train/sampling.py generate_on_grid)


@pytest.mark.ranks
@pytest.mark.compile
@pytest.mark.usefixtures("one_thread")
def test_compiled_tensor_parallel_ranks_match_one_process(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """train.compile on an x = 2 grid: the blocks compile once (their Linear3D layers run
    eagerly between the compiled regions) and train as one uncompiled process does. Dynamo used
    to trace into each Linear3D, recompile per layer and give up at its recompile limit."""
    from fourfold.config import load_config
    from fourfold.train import train
    from fourfold.train.metrics import read_metrics

    overrides = ["model.preset=debug", "train.batch_size=4", "train.seq_len=64",
                 "train.steps=3", "train.warmup_steps=1", "train.eval_every=0",
                 "train.eval_batches=0", "train.sample_tokens=0", "train.log_every=1"]
    env = outside_job_env(FOURFOLD_CACHE=str(tmp_path / "cache"))
    grid_dir = tmp_path / "grid"
    launch = torchrun_train([*overrides, "parallel.x=2", "train.compile=true"], grid_dir, env)
    assert "recompile_limit" not in launch.stderr, launch.stderr[-3000:]
    assert "torch.compile failed" not in launch.stderr, launch.stderr[-3000:]

    monkeypatch.setenv("FOURFOLD_CACHE", env["FOURFOLD_CACHE"])
    single = train(load_config(None, overrides), tmp_path / "single", progress=False)
    losses = [r["loss"] for r in read_metrics(grid_dir / "metrics.jsonl") if "loss" in r]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single.losses), rtol=1e-4,
                               atol=0)


@pytest.mark.ranks
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method, grid", [
    (["train.optimizer=lomo", "train.method.clip_mode=none"], "parallel.z=2"),
    (["train.optimizer=es", "train.method.population=4", "train.lr=1e-4", "train.grad_clip=0"],
     "parallel.data=2")])
def test_lean_method_through_fourfold_train_on_a_grid_matches_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: list[str], grid: str) -> None:
    """train.optimizer = lomo under torchrun on z = 2 (each shard updated inside backward,
    after its reduce-scatter) trains as one process does; so does es on data = 2 (both
    replicas load the same batch and evaluate half of the population each)."""
    from fourfold.config import load_config
    from fourfold.train import train
    from fourfold.train.metrics import read_metrics

    items = [*[o for o in OVERRIDES if not o.startswith("train.grad_accum")],
             *method, "train.sample_tokens=0"]
    env = outside_job_env(FOURFOLD_CACHE=str(tmp_path / "cache"))
    torchrun_train([*items, grid, "train.memory_report=true"], tmp_path / "grid", env)
    # train.memory_report on a grid: one row per rank; what can be counted exactly, is
    report = json.loads((tmp_path / "grid" / "summary.json").read_text())["memory_report"]
    predicted = report["predicted_per_rank"]
    assert len(report["measured_per_rank"]) == len(report["peak_bytes_per_rank"]) == 2
    for row, peak in zip(report["measured_per_rank"], report["peak_bytes_per_rank"]):
        assert row["parameters"] == predicted["parameters"], report
        assert row["optimizer_state"] == predicted["optimizer_state"] == 0, report
        assert peak > sum(row.values()), report  # each rank's own VmHWM: imports and all
    assert report["predicted_total_bytes"] > sum(predicted.values()), report
    monkeypatch.setenv("FOURFOLD_CACHE", env["FOURFOLD_CACHE"])
    single = train(load_config(None, items), tmp_path / "single", progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path / "grid" / "metrics.jsonl") if "loss" in r]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single.losses), rtol=1e-5,
                               atol=0)
    assert single.losses[-1] != single.losses[0]


@pytest.mark.ranks
@pytest.mark.usefixtures("one_thread")
def test_a_vocabulary_split_grid_samples_and_logs_as_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """y = 2 (logits split over the vocabulary): the samples, during training and at the end,
    are made on the grid (every rank runs the forwards on its shards, rank 0 picks) and equal
    one process's text; with train.log_every = 3 the steps between logs keep their numbers on
    the device, and the logged ones equal one process's."""
    from fourfold.config import load_config
    from fourfold.train import train
    from fourfold.train.metrics import read_metrics

    items = [*[o for o in OVERRIDES if not o.startswith("train.log_every")],
             "train.log_every=3", "train.sample_every=2"]
    env = outside_job_env(FOURFOLD_CACHE=str(tmp_path / "cache"))
    grid_dir = tmp_path / "grid"
    launch = torchrun_train([*items, "parallel.y=2"], grid_dir, env)
    assert "too large to rebuild" not in launch.stderr and "skipped on a grid" not in launch.stderr

    monkeypatch.setenv("FOURFOLD_CACHE", env["FOURFOLD_CACHE"])
    single = train(load_config(None, items), tmp_path / "single", progress=False)
    summary = json.loads((grid_dir / "summary.json").read_text())
    single_summary = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert summary["grid"] == "data=1 z=1 y=2 x=1"
    assert summary["sample"] and summary["sample"] == single_summary["sample"]
    samples = (grid_dir / "samples.txt").read_text()
    assert samples.count("--- step ") == 2  # step 2 (sample_every) and the end
    assert samples == (tmp_path / "single" / "samples.txt").read_text()
    records = [r for r in read_metrics(grid_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [3, 4]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]),
                               torch.tensor(single.losses[2:]), rtol=1e-5, atol=0)
    assert summary["skipped_steps"] == single_summary["skipped_steps"] == []
