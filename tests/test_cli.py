"""The `fourfold` command: error reporting, and each subcommand end to end on tiny inputs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fourfold import cli
from fourfold.cli import main

from conftest import JOB_VARIABLES, outside_job_env

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A run small enough to train in a couple of seconds on a laptop CPU.
TINY_TRAIN = ["--set", "train.steps=3", "--set", "train.batch_size=4", "--set", "train.seq_len=32",
              "--set", "train.eval_every=2", "--set", "train.eval_batches=1",
              "--set", "train.log_every=1", "--set", "train.sample_tokens=8",
              "--set", "train.device=cpu"]


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# --------------------------------------------------------------------------------------------
# Config mistakes: exit 2, one line, no traceback


@pytest.mark.parametrize("override, fragments", [
    ("train.step=5", ("train.step", "did you mean 'steps'")),
    ("modle.dim=64", ("[modle]", "did you mean 'model'")),
    ("train.steps=abc", ("train.steps", "expected an integer")),
    ("train.compile=maybe", ("train.compile", "true or false")),
    ("model.n_heads=5", ("model.n_heads = 5", "does not divide model.dim")),
    ("train.seq_len=100000", ("train.seq_len = 100000", "longer than model.max_seq_len")),
    ("train.dtype=float8", ("train.dtype", "float32, bfloat16")),
    ("train.steps", ("section.key=value",)),
])
def test_config_mistakes_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], override: str,
                                              fragments: tuple[str, ...]) -> None:
    code, out, err = run_main(capsys, "train", "--set", override)
    assert code == 2
    assert out == ""
    assert_one_line_error(err, *fragments)


def test_config_file_mistakes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_layer = 4\n")
    code, _, err = run_main(capsys, "train", str(bad))
    assert code == 2
    assert_one_line_error(err, "model.n_layer", "did you mean 'n_layers'")

    code, _, err = run_main(capsys, "train", str(tmp_path / "missing.toml"))
    assert code == 2
    assert_one_line_error(err, "missing.toml", "does not exist")

    code, _, err = run_main(capsys, "train", "--nproc", "0")
    assert code == 2
    assert_one_line_error(err, "--nproc 0")


def test_grid_that_cannot_fit_nproc_is_reported_before_launch(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "train", "--set", "parallel.x=2", "--set", "parallel.y=2",
                            "--nproc", "3", "--out", "unused")
    assert code == 2
    assert_one_line_error(err, "does not divide the world size 3")
    assert not list(tmp_path.iterdir())  # the run directory it would have made is not left


def test_examples_load() -> None:
    from fourfold.config import load_config

    examples = Path(__file__).resolve().parents[1] / "examples"
    loaded = {p.stem: load_config(p) for p in examples.glob("*.toml")}
    assert {"debug", "15m", "grid_2x2"} <= set(loaded)
    assert loaded["15m"].model.preset == "15m"
    grid = loaded["grid_2x2"].parallel
    assert (grid.x, grid.y, grid.data) == (2, 2, "auto")


def test_usage_errors_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.startswith("fourfold ")
    code, _, err = run_main(capsys, "frobnicate")
    assert code == 2 and "invalid choice" in err
    code, _, err = run_main(capsys, "convert", "run", "--to", "gguf", "out")
    assert code == 2 and "invalid choice" in err
    # no prefix matching: a typo must not silently become another option
    code, _, err = run_main(capsys, "train", "--npr", "2")
    assert code == 2 and "unrecognized arguments" in err


def test_interrupt_exits_130(capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_report", interrupted)
    code, _, err = run_main(capsys, "report", "anywhere")
    assert code == 130
    assert "Traceback" not in err and "interrupted" in err


def test_training_error_exits_1(capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from fourfold.train import trainer

    def diverges(cfg: object, run_dir: Path, **_: object) -> None:
        raise trainer.TrainingError("step 3: loss is nan; stopped", 3)

    monkeypatch.setattr(trainer, "train", diverges)
    code, _, err = run_main(capsys, "train", "--out", str(tmp_path / "run"))
    assert code == 1
    assert_one_line_error(err, "step 3: loss is nan")


def test_run_dir_names() -> None:
    assert cli.default_run_dir({}, now=0).parent == Path("runs")
    assert cli.default_run_dir({"WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "abc"}) == \
        Path("runs/abc")
    assert cli.default_run_dir({"WORLD_SIZE": "4", "SLURM_JOB_ID": "77"}) == Path("runs/slurm-77")
    from fourfold.config import ConfigError

    with pytest.raises(ConfigError, match="--out"):
        cli.default_run_dir({"WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "none"})


def test_rank_argv_drops_nproc_and_fixes_the_run_dir() -> None:
    typed = ["train", "cfg.toml", "--set", "train.steps=5", "--nproc", "4", "--no-resume",
             "--max-restarts", "2"]
    argv = cli._rank_argv(typed, Path("runs/x"))
    assert argv == ["train", "cfg.toml", "--set", "train.steps=5", "--no-resume",
                    "--max-restarts", "2", "--out", "runs/x"]
    rank_args = cli.build_parser().parse_args(argv)
    assert rank_args.nproc == 1 and rank_args.resume is False and rank_args.max_restarts == 2
    assert rank_args.out == "runs/x" and rank_args.overrides == ["train.steps=5"]
    typed = ["eval", "memorization", "run", "--data", "d", "--nproc=2", "--y", "2", "--json"]
    assert cli._rank_argv(typed) == ["eval", "memorization", "run", "--data", "d", "--y", "2",
                                     "--json"]


HOLD_LOCK = """
import sys, time
from fourfold.rundir import hold_run_dir
with hold_run_dir(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_one_job_at_a_time_trains_in_a_run_directory(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """A second `fourfold train` into a run directory that a job holds stops before it touches
    anything (--no-resume would move the holder's checkpoints aside), in one line that names
    the holder; the lock goes with its holder however that ends."""
    from fourfold import rundir

    for name in JOB_VARIABLES + ("FOURFOLD_LOCAL_LAUNCH",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(rundir, "LOCK_WAIT_S", 0.2)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], text=True,
                              stdout=subprocess.PIPE, env=outside_job_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        code, _, err = run_main(capsys, "train", "--out", str(run), "--no-resume", *TINY_TRAIN)
        assert code == 2
        assert_one_line_error(err, str(run), "in use by another training job",
                              f"pid {holder.pid} on ")
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
        assert [p.name for p in run.iterdir() if p.name.startswith("checkpoints")] == \
            ["checkpoints"]
    finally:
        holder.kill()  # SIGKILL: no cleanup of its own runs
        holder.wait(timeout=30)
    with rundir.hold_run_dir(run, wait_s=0.0):
        holder_line = f"pid {os.getpid()} on {socket.gethostname()}\n"
        assert (run / rundir.LOCK_FILE).read_text() == holder_line
        with pytest.raises(rundir.RunDirInUse, match="in use"):
            with rundir.hold_run_dir(run, wait_s=0.0):  # a second open file: a second holder
                pass
    with rundir.hold_run_dir(run, wait_s=0.0):  # released when the block ended
        pass


def test_a_run_directory_without_locks_trains_unguarded(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    """On a file system without flock (ENOLCK) the block runs, and an error in it carries no
    trace of the lock."""
    import errno

    from fourfold import rundir

    def no_locks(*_: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    with pytest.raises(ValueError) as raised:
        with rundir.hold_run_dir(tmp_path / "run"):
            raise ValueError("a training error")
    assert raised.value.__context__ is None


@pytest.mark.slow
def test_subprocess_exit_codes_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "fourfold", "train", "--set",
                             "model.n_heads=5"], capture_output=True, text=True, cwd=tmp_path,
                            env=outside_job_env(), timeout=120)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "model.n_heads = 5")

    script = Path(sysconfig.get_path("scripts")) / "fourfold"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "fourfold"]
    result = subprocess.run([*command, "report", str(tmp_path / "nowhere")],
                            capture_output=True, text=True, env=outside_job_env(), timeout=120)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "nowhere")


# --------------------------------------------------------------------------------------------
# report


def test_report_writes_pngs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    records = [{"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 1000.0 + s,
                "peak_mem_bytes": 2 ** 28 + s} for s in range(1, 11)]
    records.insert(5, {"step": 5, "val_loss": 4.6})
    records.append({"step": 10, "val_loss": 4.1})
    text = "\n".join(json.dumps(r) for r in records) + "\n" + '{"step": 11, "lo'  # torn line
    (tmp_path / "metrics.jsonl").write_text(text)
    code, out, err = run_main(capsys, "report", str(tmp_path))
    assert code == 0, err
    paths = [Path(line) for line in out.splitlines()]
    assert sorted(p.name for p in paths) == ["loss.png", "memory.png", "tokens_per_s.png",
                                            "val_loss.png"]
    for path in paths:
        assert path.parent == tmp_path / "report"
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        assert path.stat().st_size > 2000


def test_report_without_metrics(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "report", str(tmp_path))
    assert code == 2
    assert_one_line_error(err, "metrics.jsonl", "does not exist")
    (tmp_path / "metrics.jsonl").write_text("\n")
    code, _, err = run_main(capsys, "report", str(tmp_path))
    assert code == 2
    assert_one_line_error(err, "no metrics")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lr": 0.1}\n')
    code, _, err = run_main(capsys, "report", str(tmp_path))
    assert code == 2
    assert_one_line_error(err, "none of the plotted metrics")


# --------------------------------------------------------------------------------------------
# prepare -> train -> generate / eval / report / convert, on a tiny corpus


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DATA_DIR made by `fourfold prepare` from a few standard library modules."""
    source = tmp_path_factory.mktemp("text")
    stdlib = Path(sysconfig.get_path("stdlib"))
    for name in ("textwrap.py", "string.py", "bisect.py", "colorsys.py", "fnmatch.py",
                 "heapq.py", "keyword.py", "shlex.py", "struct.py", "this.py"):
        if (stdlib / name).exists():
            shutil.copy(stdlib / name, source / name)
    out = tmp_path_factory.mktemp("data")
    assert main(["prepare", str(source), "--out", str(out), "--tokenizer", "byte"]) == 0
    return out


@pytest.fixture(scope="module")
def trained(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One tiny training run for the whole module: its directory, stdout and stderr."""
    run = tmp_path_factory.mktemp("runs") / "tiny"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "--set", f"data.path={data_dir}", *TINY_TRAIN, "--out", str(run)])
    assert code == 0, err.getvalue()
    return run, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def trained_run(trained: tuple[Path, str, str]) -> Path:
    return trained[0]


def test_prepare_mistakes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "prepare", str(tmp_path / "absent.txt"), "--out",
                            str(tmp_path / "d"))
    assert code == 2
    assert "Traceback" not in err and err.startswith("error: ")
    (tmp_path / "a.txt").write_text("hello world\n")
    code, _, err = run_main(capsys, "prepare", str(tmp_path / "a.txt"), "--out",
                            str(tmp_path / "d"), "--tokenizer", "wordpiece")
    assert code == 2
    assert_one_line_error(err, "wordpiece")


@pytest.mark.slow
def test_train_prints_where_the_run_is(trained: tuple[Path, str, str]) -> None:
    run, out, err = trained
    for name in ("config.toml", "metrics.jsonl", "model.safetensors", "summary.json"):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    assert f"run files: {run}" in out
    assert "model.safetensors" in out and ".lock" not in out  # the run directory's lock
    assert (run / ".lock").is_file()
    assert "sample" in out + err  # the trainer shows the final sample


@pytest.mark.slow
def test_generate(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", str(trained_run), "--prompt", "def f(", "--max-new-tokens", "12",
            "--seed", "3"]
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    assert out.startswith("def f(")
    code, again, _ = run_main(capsys, *argv)
    assert again == out  # the same seed gives the same text
    code, greedy, _ = run_main(capsys, *argv[:-2], "--temperature", "0")
    assert code == 0 and greedy.startswith("def f(")

    code, _, err = run_main(capsys, "generate", str(trained_run), "--prompt", "x",
                            "--temperature", "-1")
    assert code == 2
    assert_one_line_error(err, "--temperature -1")
    code, _, err = run_main(capsys, "generate", str(trained_run.parent / "nope"), "--prompt", "x")
    assert code == 2
    assert_one_line_error(err, "nope")


@pytest.mark.slow
def test_eval_memorization(trained_run: Path, data_dir: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "eval", "memorization", str(trained_run), "--data",
                              str(data_dir), "--docs", "2", "--prefix", "8", "--suffix", "4",
                              "--json")
    assert code == 0, err
    # the command's report (what the audit measures: tests/test_memorization*.py): the
    # documents and lengths asked for, each rate the mean of its rows
    report = json.loads(out)
    assert (report["documents_audited"], report["prefix"], report["suffix"]) == (2, 8, 4)
    rows = report["rows"]
    assert [row["document"] for row in rows] == [0, 1]
    for rate, column in (("exact_match_rate", "exact_match"), ("token_match_rate", "token_match"),
                         ("rouge_l", "rouge_l")):
        assert report[rate] == pytest.approx(sum(row[column] for row in rows) / 2), rate
    code, _, err = run_main(capsys, "eval", "memorization", str(trained_run), "--data",
                            str(data_dir), "--docs", "0")
    assert code == 2
    assert_one_line_error(err, "--docs 0")


@pytest.mark.slow
def test_report_on_a_trained_run(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "report", str(trained_run))
    assert code == 0, err
    names = {Path(line).name for line in out.splitlines()}
    assert {"loss.png", "val_loss.png", "tokens_per_s.png", "memory.png"} <= names


# --------------------------------------------------------------------------------------------
# convert (more in test_hf.py)


@pytest.mark.slow
def test_convert_trained_run_to_hf(trained_run: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from fourfold.train.runs import load_trained

    from test_hf import EXPORT_FILES, assert_export_matches

    out_dir = tmp_path / "hf"
    code, out, err = run_main(capsys, "convert", str(trained_run), "--to", "hf", str(out_dir))
    assert code == 0, err
    assert {Path(p).name for p in out.split()} == EXPORT_FILES
    model, _ = load_trained(trained_run)
    assert_export_matches(out_dir, model, ["def f(x):\n    return x\n"])


def test_convert_missing_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "convert", str(tmp_path / "none"), "--to", "hf",
                            str(tmp_path / "out"))
    assert code == 2
    assert_one_line_error(err, "none")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# plan: its arguments go to the planner unparsed


def test_plan_passes_its_arguments_through(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "plan", "--model", "debug", "--gpus", "2", "--machine",
                            "no-such-machine")
    assert code == 2
    assert_one_line_error(err, "no-such-machine")
    code, out, err = run_main(capsys, "plan", "--model", "debug", "--gpus", "2", "--machine",
                              "dgx-h100", "--json")
    assert code == 0, err
    assert json.loads(out)
    code, out, _ = run_main(capsys, "plan", "--help")
    assert code == 0 and "--machine" in out


def test_ranks_of_a_slurm_job_do_not_launch_again(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_STEPID",
                 "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    assert not cli._inside_job() and cli._is_main_rank()
    # srun sets the step's variables for each task of the step
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # one task: --nproc starts the ranks itself
    assert not cli._inside_job()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert cli._inside_job() and not cli._is_main_rank()
    # a batch script of a 4-task job has the job's variables but no step: one process
    monkeypatch.delenv("SLURM_STEP_ID")
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    assert not cli._inside_job() and cli._is_main_rank()
    monkeypatch.setenv("RANK", "0")  # torchrun's variable wins once set
    assert cli._inside_job() and cli._is_main_rank()
