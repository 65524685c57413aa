"""`fourfold train --nproc N`: local ranks started by torch's elastic launcher."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fourfold.host import threads_per_rank
from fourfold.launch import describe_failure, first_exit_code
from fourfold.parallel.grid import (GridError, cuda_index, expand_counts, first_host,
                                    is_slurm_step, local_task_count, slurm_port, slurm_rank_env,
                                    threads_for_rank)

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


def _fourfold(*argv: str, cwd: Path, extra_env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fourfold", *argv], capture_output=True,
                          text=True, cwd=cwd, env={**_env(), **(extra_env or {})}, timeout=300)


@pytest.mark.ranks
def test_train_on_two_local_ranks(tmp_path: Path) -> None:
    """One launch checks: exit code 0, only rank 0 prints, the run files and the grid used.
    (test_train_multirank compares two data ranks with one process, under torchrun.)
    It runs as in the batch script of `sbatch --ntasks=4` (no srun): --nproc starts its ranks
    there, rather than the script taking itself for rank 0 of the job's 4 tasks."""
    two = _fourfold("train", *TINY, "--nproc", "2", "--out", str(tmp_path / "two"), cwd=tmp_path,
                    extra_env=SLURM_BATCH)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "Traceback" not in two.stderr and "note:" not in two.stderr
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
    # A mistake found only once the ranks have met (3 rows do not split over 2 data ranks):
    # still one line, and no rank's connection broken under a peer (one barrier after the
    # grid's groups; before it, a fast rank's exit could leave a peer with gloo's traceback).
    odd = _fourfold("train", *TINY, "--set", "train.batch_size=3", "--nproc", "2",
                    "--out", str(tmp_path / "odd"), cwd=tmp_path)
    assert odd.returncode == 2 and "Traceback" not in odd.stderr, odd.stderr[-3000:]
    errors = [line for line in odd.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.batch_size = 3" in errors[0], odd.stderr


# ---- Slurm and multi-node, with the variables Slurm 22.05 set (recorded on slurm-local) ----

# `sbatch --ntasks=4 job.sh`: the batch script itself (no srun)
SLURM_BATCH = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_NODELIST": "n1",
               "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_PROCID": "0",
               "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4",
               "SLURM_CPUS_ON_NODE": "4", "SLURM_GTIDS": "0"}
# `srun` inside `sbatch --nodes=2 --ntasks=4 --ntasks-per-node=2`: the task on n2 with rank 3
SLURM_STEP_TASK3 = {"SLURM_JOB_ID": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                    "SLURM_NODELIST": "n[1-2]", "SLURM_NTASKS": "4", "SLURM_PROCID": "3",
                    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_GTIDS": "2,3",
                    "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)",
                    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
                    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4",
                    "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
# `srun -N1 -n2 -w n2` inside that same two-node job: a second step on n2 only
SLURM_STEP_ON_N2 = {**SLURM_STEP_TASK3, "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                    "SLURM_NODEID": "0", "SLURM_GTIDS": "0,1", "SLURM_NTASKS": "2",
                    "SLURM_STEP_ID": "1", "SLURM_STEPID": "1", "SLURM_STEP_NODELIST": "n2",
                    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2",
                    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2"}


def test_a_batch_script_is_one_process_and_a_step_task_is_a_rank() -> None:
    assert not is_slurm_step(SLURM_BATCH) and slurm_rank_env(SLURM_BATCH) == {}
    assert slurm_rank_env({**SLURM_BATCH, "SLURM_STEP_ID": "4294967294",
                           "SLURM_STEP_NUM_TASKS": "4"}) == {}  # the batch step by id
    task = slurm_rank_env(SLURM_STEP_TASK3)
    assert task == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "n1", "MASTER_PORT": str(slurm_port(2, 0))}
    # a step on n2 alone meets on n2 (the job's list starts with n1), on a port of its own
    step = slurm_rank_env(SLURM_STEP_ON_N2)
    assert step["MASTER_ADDR"] == "n2" and step["WORLD_SIZE"] == "2"
    assert step["LOCAL_WORLD_SIZE"] == "2" and step["MASTER_PORT"] != task["MASTER_PORT"]
    # a one-task step is one process (--nproc may start ranks there)
    assert slurm_rank_env({**SLURM_STEP_ON_N2, "SLURM_STEP_NUM_TASKS": "1"}) == {}
    # what the user set wins
    mine = slurm_rank_env({**SLURM_STEP_TASK3, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("head", "4000")


def test_node_lists_and_task_counts() -> None:
    assert first_host("n[1-2]") == "n1"
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("cpu1,gpu[07-09]") == "cpu1"
    assert first_host("nid[001-004]-ib") == "nid001-ib"
    assert first_host("login") == "login"
    assert expand_counts("2(x3),1") == [2, 2, 2, 1] and expand_counts("") == []
    assert local_task_count(SLURM_STEP_TASK3) == 2
    uneven = {**SLURM_STEP_TASK3, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1"}
    assert local_task_count(uneven) == 1
    no_step = {k: v for k, v in SLURM_STEP_TASK3.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    assert local_task_count(no_step) == 2  # from SLURM_GTIDS


def test_rendezvous_ports_of_steps_and_nearby_jobs_differ() -> None:
    ports = {(job, step): slurm_port(job, step) for job in range(1, 301) for step in range(4)}
    assert len(set(ports.values())) == len(ports)
    assert slurm_port(17, 0) != slurm_port(1017, 0) != slurm_port(2017, 0)
    assert all(10000 <= p < 32768 for p in ports.values())  # below Linux's ephemeral ports


def test_threads_are_the_cores_of_this_node_split_among_its_tasks() -> None:
    one_per_node = {**SLURM_STEP_TASK3, "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                    "SLURM_STEP_NUM_TASKS": "2"}
    # one task per node: all of the node's cores, not cores / world size
    assert threads_for_rank(one_per_node, local_task_count(one_per_node), cores=2) == 2
    assert threads_for_rank(SLURM_STEP_TASK3, local_task_count(SLURM_STEP_TASK3), cores=16) == 8
    bound = {**SLURM_STEP_TASK3, "SLURM_CPUS_PER_TASK": "3"}  # Slurm gave each task 3 cores
    assert threads_for_rank(bound, 2, cores=16) == 3


def test_each_rank_takes_a_gpu_it_can_see() -> None:
    assert cuda_index(local_rank=3, local_world=4, visible=4) == 3  # every task sees all GPUs
    assert cuda_index(local_rank=3, local_world=4, visible=1) == 0  # --gpus-per-task=1
    assert cuda_index(local_rank=1, local_world=4, visible=2) == 0  # --gpus-per-task=2
    assert cuda_index(local_rank=1, local_world=2, visible=8) == 1
    with pytest.raises(GridError, match="sees no CUDA device"):
        cuda_index(local_rank=0, local_world=1, visible=0)


@pytest.mark.slow
def test_a_rank_whose_job_never_assembles_ends_with_one_line(tmp_path: Path) -> None:
    """Rank 0 of a 2-task srun step whose other task never comes; then a rank 1 whose rank 0
    never comes: each ends in one `error:` line (no traceback) within parallel.timeout_s."""
    step = {**SLURM_STEP_ON_N2, "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "4242"}
    short = ["--set", "parallel.timeout_s=3", "--out", str(tmp_path / "run")]
    for rank, expected in (("0", "waited 3 s"), ("1", "could not join the job at localhost")):
        env = {**_env(), **step, "SLURM_PROCID": rank, "SLURM_LOCALID": rank}
        result = subprocess.run([sys.executable, "-m", "fourfold", "train", *TINY, *short],
                                capture_output=True, text=True, cwd=tmp_path, env=env,
                                timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stderr, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"error: rank {rank}" in errors[0], result.stderr
        assert expected in errors[0], errors


def _check_shared_worker(rank: int, world: int, port: int, root: str) -> None:
    import datetime

    import torch.distributed as dist

    from fourfold.parallel.grid import Grid, GridShape, check_shared_directory

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    grid = Grid.build(GridShape(z=2))
    # z gathers have a group of their own, with the same ranks as z's
    gather, z = grid.gather_group("z"), grid.group("z")
    assert gather is not None and gather is not z
    assert dist.get_process_group_ranks(gather) == dist.get_process_group_ranks(z)
    assert grid.gather_group("x") is None and grid.tensor_group is not None
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=gather)
    assert t.item() == sum(range(world))
    check_shared_directory(Path(root) / "shared", grid)  # every rank sees it: passes
    own = Path(root) / ("shared" if rank != 1 else "elsewhere")  # rank 1 on a node of its own
    try:
        check_shared_directory(own, grid)
    except GridError as error:
        Path(root, f"error{rank}").write_text(str(error))
    dist.destroy_process_group()


@pytest.mark.ranks
def test_ranks_that_do_not_share_the_run_directory_fail_in_one_line(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_check_shared_worker, args=(2, port, str(tmp_path)), nprocs=2)
    messages = {(tmp_path / f"error{r}").read_text() for r in range(2)}
    assert len(messages) == 1, messages  # every rank fails, with the same line
    message = messages.pop()
    assert "is not shared by all ranks: rank(s) 1 on" in message and "\n" not in message
    assert str(tmp_path / "shared") in message  # the directory as rank 0 sees it
    assert not (tmp_path / "shared" / ".fourfold-shared").exists()


def test_what_fourfold_makes_of_a_slurm_allocation_is_said_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fourfold import cli

    for name in ("RANK", *SLURM_STEP_TASK3):
        monkeypatch.delenv(name, raising=False)
    for name, value in SLURM_BATCH.items():
        monkeypatch.setenv(name, value)
    cli._note_slurm_launch(nproc=1)  # a batch script of 4 tasks training on one process
    assert "has 4 tasks but this batch script is one process" in capsys.readouterr().err
    cli._note_slurm_launch(nproc=4)  # --nproc in a batch script: what the user asked for
    assert capsys.readouterr().err == ""
    for name, value in {**SLURM_STEP_TASK3, "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(name, value)
    cli._note_slurm_launch(nproc=4)  # --nproc inside a 4-task step
    assert "--nproc 4 ignored: the 4 tasks of this srun step are the ranks" in \
        capsys.readouterr().err
    monkeypatch.setenv("SLURM_PROCID", "3")
    cli._note_slurm_launch(nproc=4)  # said by rank 0 only
    assert capsys.readouterr().err == ""
