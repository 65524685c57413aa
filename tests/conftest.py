"""Shared fixtures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


# What a launcher or a scheduler sets for a rank: a test that starts fourfold as a fresh job
# (its own launcher, or one process) must not hand these down from the environment it runs in.
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEPID",
                 "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


def outside_job_env(**extra: str) -> dict[str, str]:
    """This process's environment without the job variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    env.update(extra)
    return env


def run_grid_worker(worker: Path, nproc: int, grids: list, cases: list, cases_env: str,
                    out: Path) -> list[dict]:
    """`worker` under torchrun on `nproc` ranks, each of `grids` with each of `cases` (handed
    over in FOURFOLD_TEST_SHAPES and `cases_env`): its JSON lines from `out`, one per grid and
    case, each checked to have run."""
    env = outside_job_env(FOURFOLD_TEST_SHAPES=json.dumps(grids), FOURFOLD_TEST_OUT=str(out),
                          OMP_NUM_THREADS="1", PYTHONPATH=str(worker.parent),
                          **{cases_env: json.dumps(cases)})
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone", str(worker)],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == len(grids) * len(cases)
    for r in results:
        case = r.get("check", r.get("case"))
        assert r["ok"], f"grid {r['shape']} case {case}:\n{r.get('error')}"
    return results


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One thread for a test module: these tiny models gain nothing from more, and on a busy
    machine several threads spin-wait for each other."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old_threads)


@pytest.fixture(scope="module")
def fourfold_cache(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Iterator[Path]:
    """A private FOURFOLD_CACHE (built-in corpus, CPU peak probe) for one test module, on one
    thread."""
    old_cache = os.environ.get("FOURFOLD_CACHE")
    os.environ["FOURFOLD_CACHE"] = str(tmp_path_factory.mktemp("fourfold-cache"))
    yield Path(os.environ["FOURFOLD_CACHE"])
    if old_cache is None:
        del os.environ["FOURFOLD_CACHE"]
    else:
        os.environ["FOURFOLD_CACHE"] = old_cache
