"""`fourfold train --nproc N`: local ranks started by torch's elastic launcher."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fourfold.host import threads_per_rank
from fourfold.launch import describe_failure, first_exit_code

from conftest import outside_job_env

# The debug preset on the built-in corpus, a few steps: seconds per launch.
TINY = ["--set", "model.preset=debug", "--set", "data.path=builtin:stdlib",
        "--set", "data.tokenizer=byte", "--set", "train.steps=3", "--set", "train.batch_size=4",
        "--set", "train.seq_len=32", "--set", "train.eval_every=3", "--set", "train.eval_batches=1",
        "--set", "train.log_every=1", "--set", "train.sample_tokens=8", "--set", "train.device=cpu"]


@dataclass
class FakeFailure:
    exitcode: int
    message: str = ""


class FakeChildFailed(Exception):
    def __init__(self, failures: dict[int, FakeFailure]) -> None:
        super().__init__("child failed")
        self.failures = failures


def test_threads_split_the_cores() -> None:
    assert threads_per_rank(2, cores=16) == 8
    assert threads_per_rank(3, cores=16) == 5
    assert threads_per_rank(4, cores=2) == 1


def test_failure_line_names_the_rank_that_failed() -> None:
    stopped = FakeFailure(-int(signal.SIGTERM))
    hint = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    failure = FakeChildFailed({0: stopped, 1: FakeFailure(3, hint)})
    assert describe_failure(failure) == "rank 1 exited with code 3"
    assert first_exit_code(failure) == 3

    killed = FakeChildFailed({2: FakeFailure(-int(signal.SIGKILL)),
                              0: FakeFailure(-int(signal.SIGSEGV))})
    assert describe_failure(killed) == "rank 0 killed by signal SIGSEGV"
    assert first_exit_code(killed) == 128 + int(signal.SIGSEGV)

    same = FakeChildFailed({r: FakeFailure(2, "data.path = 'x': not found") for r in range(4)})
    assert describe_failure(same) == "ranks 0, 1, 2, 3 exited with code 2: data.path = 'x': not found"

    mixed = FakeChildFailed({0: FakeFailure(1, "ValueError: boom\nmore"), 1: FakeFailure(2, "a"),
                             2: FakeFailure(3, "b"), 3: FakeFailure(4, "c")})
    line = describe_failure(mixed)
    assert line == ("rank 0 exited with code 1: ValueError: boom; rank 1 exited with code 2: a; "
                    "and 2 more")
    assert first_exit_code(mixed) == 1


def _env() -> dict[str, str]:
    env = outside_job_env()
    env.pop("OMP_NUM_THREADS", None)  # the launcher sets it for its ranks
    return env


def _fourfold(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fourfold", *argv], capture_output=True,
                          text=True, cwd=cwd, env=_env(), timeout=300)


@pytest.mark.ranks
def test_train_on_two_local_ranks(tmp_path: Path) -> None:
    """One launch checks: exit code 0, only rank 0 prints, the run files and the grid used.
    (test_train_multirank compares two data ranks with one process, under torchrun.)"""
    two = _fourfold("train", *TINY, "--nproc", "2", "--out", str(tmp_path / "two"), cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "Traceback" not in two.stderr
    assert two.stdout.count("run files:") == 1  # rank 0 only, not the launcher or rank 1
    run = tmp_path / "two"
    for name in ("config.toml", "metrics.jsonl", "model.safetensors", "summary.json"):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["grid"].startswith("data=2")
    assert summary["steps"] == 3 and summary["final_loss"] > 0


@pytest.mark.ranks
def test_failed_ranks_give_one_line_and_their_exit_code(tmp_path: Path) -> None:
    # Every rank finds the missing data directory after the launch.
    result = _fourfold("train", *TINY, "--set", f"data.path={tmp_path / 'missing'}",
                       "--nproc", "2", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    # One line for the whole job: the launcher's, carrying the ranks' own message.
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("error: rank"), errors
    assert "exited with code 2: data.path" in errors[0] and "missing" in errors[0], errors
