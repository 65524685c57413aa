"""Shared fixtures, and the rule that keeps the quick tier quick."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch

# The markers that take a test out of the quick tier (`make check`); pyproject.toml says what
# each one is for.
TIER_MARKERS = ("ranks", "compile", "slow")
# The longest a quick-tier test's own run may take, in seconds (FOURFOLD_QUICK_LIMIT_S; 0
# turns the rule off). Its fixtures' setup does not count: a module's shared corpus or model
# is built once for many tests.
QUICK_LIMIT_ENV = "FOURFOLD_QUICK_LIMIT_S"
QUICK_LIMIT_S = 3.0


def _quick_limit_s() -> float:
    text = os.environ.get(QUICK_LIMIT_ENV, "")
    try:
        return float(text) if text else QUICK_LIMIT_S
    except ValueError:
        raise pytest.UsageError(f"{QUICK_LIMIT_ENV}={text!r}: expected seconds, e.g. 10 "
                                "(0 turns the limit off)") from None


def pytest_configure(config: pytest.Config) -> None:
    _quick_limit_s()  # a bad value stops the session once, before any test runs


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (a test's subprocess
    counts once the test has reaped it)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _load_factor() -> float:
    """How many times over this machine's cores are asked for (the last minute's load average
    per core, at least 1): other work's share of the time a test takes."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except (OSError, AttributeError):
        return 1.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """Fail a quick-tier test whose call ran longer than the limit, saying to mark it.

    A test is too slow when both its wall time and its CPU time (with the children it reaped)
    are over the limit: on an idle machine a test that briefly keeps two cores busy uses more
    CPU time than wall time, and one that waits does not burn CPU. On a machine loaded by
    other work both stretch (torch's threads spin while they wait for a core), so the limit is
    scaled by the load per core: under load only a clearly slow test fails, and the idle
    machine's verdict is the strict one. (A test that only waits, using no CPU, is not
    caught.)"""
    limit = _quick_limit_s()
    wall, cpu = time.perf_counter(), _cpu_seconds()
    result = yield  # the test's own failure propagates from here unchanged
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    quick = not any(item.get_closest_marker(name) for name in TIER_MARKERS)
    load = _load_factor()
    if quick and limit > 0 and min(wall, cpu) > limit * load:
        pytest.fail(f"{item.nodeid} took {wall:.1f} s ({cpu:.1f} s of CPU), over the quick "
                    f"tier's {limit:g} s (x {load:.1f}, this machine's load per core): mark it "
                    "@pytest.mark.slow (one process) or @pytest.mark.ranks (it starts ranks), "
                    f"or make it faster; on a slow host raise the limit with "
                    f"{QUICK_LIMIT_ENV}=SECONDS", pytrace=False)
    return result


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
