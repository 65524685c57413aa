"""Shared fixtures."""

from __future__ import annotations

import os
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
