"""A run directory as the user walks it (through the `fourfold` command, in this process):
`fourfold train RUN_DIR` resumes it; damaged checkpoints stop the run; --resume, --no-resume;
a change of method, model shape, data or tokenizer since the checkpoint is named; the run's
tokenizer lives in RUN_DIR and every command that reads token ids checks it."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from fourfold.cli import main
from fourfold.data import prepare
from fourfold.rundir import list_checkpoints, saved_identity

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py

TINY = ["model.preset=debug", "model.n_layers=1", "model.dim=64", "model.n_heads=2",
        "model.n_kv_heads=1", "model.ffn_dim=128", "train.batch_size=4", "train.seq_len=32",
        "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=0",
        "train.sample_tokens=0", "train.log_every=1", "checkpoint.every=2"]


def sets(*overrides: str) -> list[str]:
    return [item for o in [*TINY, *overrides] for item in ("--set", o)]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("error:", "Traceback"))]


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Some of the Python standard library's source as the user's own text."""
    root = tmp_path_factory.mktemp("text")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py"):
        shutil.copy(stdlib / name, root / name)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, texts: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    out = {"byte": root / "byte", "bpe": root / "bpe"}
    prepare([texts], out["byte"], tokenizer="byte", val_fraction=0.1, progress=False)
    prepare([texts], out["bpe"], tokenizer="bpe:400", val_fraction=0.1, progress=False)
    return out


@pytest.fixture(scope="module")
def run4(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Path]) -> Path:
    """A run of 4 steps with checkpoints at 2 and 4, on byte data."""
    run = tmp_path_factory.mktemp("runs") / "run"
    assert main(["train", *sets("train.steps=4", f"data.path={data['byte']}"),
                 "--out", str(run)]) == 0
    return run


def copy_run(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def test_the_run_directory_records_its_tokenizer_and_absolute_paths(run4: Path,
                                                                    data: dict[str, Path]):
    config = (run4 / "config.toml").read_text()
    assert f'path = "{data["byte"].resolve()}"' in config
    assert 'tokenizer_fingerprint = "byte"' in config
    assert (run4 / "tokenizer" / "fourfold_tokenizer.json").is_file()
    assert json.loads((run4 / "summary.json").read_text())["tokenizer_fingerprint"] == "byte"
    identity = saved_identity(list_checkpoints(run4)[0])
    assert identity["tokenizer"] == "byte" and identity["train.optimizer"] == "adamw"
    assert identity["model.dim"] == "64" and identity["data"].startswith("sha256:")


def test_train_run_dir_resumes_that_run(run4: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]):
    run = copy_run(run4, tmp_path)
    code, err = run_cli(capsys, "train", str(run), "--set", "train.steps=6")
    assert code == 0, err
    assert "continuing from" in err and "step_00000004" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6
    assert [p.name for p in list_checkpoints(run)][0] == "step_00000006"


def test_damaged_checkpoints_stop_the_run_and_stay(run4: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]):
    run = copy_run(run4, tmp_path)
    (run / "checkpoints" / "step_00000004" / "manifest.json").unlink()
    shard = next((run / "checkpoints" / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, err = run_cli(capsys, "train", str(run), "--set", "train.steps=6")
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert "step_00000004 (no manifest.json)" in lines[0]
    assert "step_00000002 (" in lines[0] and "truncated" in lines[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_no_resume_moves_old_checkpoints_aside(run4: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]):
    run = copy_run(run4, tmp_path)
    code, err = run_cli(capsys, "train", str(run), "--no-resume", "--set", "train.steps=2")
    assert code == 0, err
    aside = [p for p in run.iterdir() if p.name.startswith("checkpoints.before-")]
    assert len(aside) == 1 and str(aside[0]) in err
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002"]
    assert sorted(p.name for p in aside[0].iterdir()) == ["step_00000002", "step_00000004"]
    assert "continuing from" not in err


def test_resume_without_a_checkpoint_is_an_error(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]):
    code, err = run_cli(capsys, "train", "--resume", "--out", str(tmp_path / "new"))
    assert code == 2
    assert error_lines(err) == [f"error: --resume: {str(tmp_path / 'new')!r} holds no "
                                "checkpoint (checkpoints/step_*); leave --resume out to start "
                                "a new run there"]
    code, err = run_cli(capsys, "train", "--resume")
    assert code == 2 and "no run directory to resume" in err


@pytest.mark.parametrize("change, named", [
    ("train.optimizer=lomo", "train.optimizer adamw -> lomo"),
    ("model.dim=32", "model.dim 64 -> 32"),
    ("data.path=OTHER", "data "),
])
def test_resuming_after_a_change_names_it(run4: Path, tmp_path: Path, data: dict[str, Path],
                                          texts: Path, capsys: pytest.CaptureFixture[str],
                                          change: str, named: str):
    run = copy_run(run4, tmp_path)
    if change == "data.path=OTHER":  # other text, the same tokenizer
        other, text = tmp_path / "other", tmp_path / "text"
        shutil.copytree(texts, text, ignore=shutil.ignore_patterns("textwrap.py"))
        prepare([text], other, tokenizer="byte", val_fraction=0.2, progress=False)
        change = f"data.path={other}"
    code, err = run_cli(capsys, "train", str(run), "--set", change, "--set", "train.steps=6")
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and "cannot resume from" in lines[0] and named in lines[0], err
    if named == "data ":
        assert f"{data['byte'].resolve()} (sha256:" in lines[0] and str(other) in lines[0]
    assert [p.name for p in list_checkpoints(run)] == ["step_00000004", "step_00000002"]


def test_another_tokenizer_is_refused_by_every_command(run4: Path, tmp_path: Path,
                                                       data: dict[str, Path],
                                                       capsys: pytest.CaptureFixture[str]):
    run = copy_run(run4, tmp_path)
    bpe = str(data["bpe"])
    # resuming (or training the run again) on data of another tokenizer
    code, err = run_cli(capsys, "train", str(run), "--set", f"data.path={bpe}")
    assert code == 2 and "tokenizer" in err and "byte" in err and "sha256:" in err, err
    assert len(error_lines(err)) == 1
    # the memorization audit on data of another tokenizer
    code, err = run_cli(capsys, "eval", "memorization", str(run), "--data", bpe, "--docs", "2")
    assert code == 2 and "byte" in err and "sha256:" in err, err
    # a run whose tokenizer copy was swapped: generate and convert refuse to decode with it
    shutil.rmtree(run / "tokenizer")
    shutil.copytree(data["bpe"], run / "tokenizer",
                    ignore=shutil.ignore_patterns("*.bin", "manifest.json", "train", "val"))
    code, err = run_cli(capsys, "generate", str(run), "--prompt", "def ")
    assert code == 2 and "byte" in err and "sha256:" in err, err
    code, err = run_cli(capsys, "convert", str(run), "--to", "hf", str(tmp_path / "hf"))
    assert code == 2 and "byte" in err and "sha256:" in err, err


def test_init_from_checks_the_tokenizer_and_continues_a_run(run4: Path, tmp_path: Path,
                                                            data: dict[str, Path],
                                                            capsys: pytest.CaptureFixture[str]):
    import torch

    from fourfold.train import Trainer, load_trained
    from fourfold.config import load_config

    # a fourfold run directory: on data of another tokenizer, refused
    code, err = run_cli(capsys, "train", *sets(f"data.path={data['bpe']}",
                                               f"model.init_from={run4}", "train.steps=1"),
                        "--out", str(tmp_path / "refused"))
    assert code == 2 and "model.init_from" in err and "tokenizer" in err, err
    assert "vocab_size" not in err
    # on its own data it starts from the run's weights (its model shape from its config)
    cfg = load_config(None, [*TINY, "model.dim=256", f"data.path={data['byte']}",
                             f"model.init_from={run4}", "train.steps=1"])
    trainer = Trainer(cfg, tmp_path / "continued", progress=False)
    trained, _ = load_trained(run4)
    mine = dict(trainer.pmodel.module.named_parameters())
    for name, tensor in trained.named_parameters():
        assert torch.equal(mine[name].detach(), tensor.detach()), name


@pytest.mark.slow  # transformers' import and model load
def test_the_users_path_from_own_text_to_transformers(texts: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]):
    """prepare own text with bpe:N -> train -> move the data away -> generate and convert from
    another directory -> AutoTokenizer and AutoModelForCausalLM load the export and agree with
    fourfold's tokenizer and logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fourfold.train import load_trained
    from fourfold.train.runs import run_config, run_tokenizer

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    assert run_cli(capsys, "prepare", str(texts), "--out", "data", "--tokenizer", "bpe:300")[0] == 0
    code, err = run_cli(capsys, "train", *sets("train.steps=3", "data.path=data",
                                               "checkpoint.every=0"), "--out", "run")
    assert code == 0, err
    (work / "data").rename(tmp_path / "moved-data")  # the run needs it no more
    monkeypatch.chdir(elsewhere)
    run = work / "run"
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["report", str(run)]) == 0
    assert main(["convert", str(run), "--to", "hf", "hf"]) == 0
    capsys.readouterr()

    ours = run_tokenizer(run, run_config(run))
    theirs = AutoTokenizer.from_pretrained(elsewhere / "hf")
    text = "def fnmatch(name, pat):\n    return True"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text).tolist()
    hf_model = AutoModelForCausalLM.from_pretrained(elsewhere / "hf", dtype=torch.float32)
    model, _ = load_trained(run)
    ids = torch.tensor([ours.encode(text).tolist()])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), atol=1e-5, rtol=1e-5)


def _start(run_args: list[str], cwd: Path) -> "subprocess.Popen[str]":
    import os
    import subprocess
    import sys

    from conftest import outside_job_env

    env = outside_job_env(FOURFOLD_CACHE=os.environ["FOURFOLD_CACHE"])
    return subprocess.Popen([sys.executable, "-m", "fourfold", "train", *run_args, "--nproc",
                             "2"], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _signal_after_steps(proc: "subprocess.Popen[str]", metrics: Path, steps: int,
                        signum: int) -> tuple[int, str]:
    """Send `signum` to the whole job (launcher and ranks, as Ctrl-C or Slurm do) once
    metrics.jsonl holds `steps` lines; the job's exit code and stderr."""
    import os
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            os.killpg(proc.pid, signum)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.ranks
@pytest.mark.slow
def test_sigterm_checkpoints_and_resumes_bit_for_bit_and_ctrl_c_exits_130(
        data: dict[str, Path], tmp_path: Path):
    import signal

    from safetensors.torch import load_file

    steps = 80
    args = sets(f"train.steps={steps}", f"data.path={data['byte']}", "checkpoint.every=0")
    reference = _start([*args, "--out", "reference"], tmp_path)
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err

    # SIGTERM mid-training: the ranks finish the step, write a checkpoint, one line, 143
    run = tmp_path / "run"
    code, err = _signal_after_steps(_start([*args, "--out", "run"], tmp_path),
                                    run / "metrics.jsonl", 3, signal.SIGTERM)
    assert code == 143, err
    assert "Traceback" not in err and "error:" not in err, err
    stopped = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1, err
    saved = list_checkpoints(run)
    assert len(saved) == 1 and str(saved[0].relative_to(tmp_path)) in stopped[0]
    step = int(saved[0].name.split("_")[1])
    assert 3 <= step < steps  # stopped before the end
    assert not (run / "model.safetensors").exists()

    # Ctrl-C on both ranks and the launcher while resumed: one line, 130, no traceback
    code, err = _signal_after_steps(_start(["run"], tmp_path), run / "metrics.jsonl",
                                    step + 3, signal.SIGINT)
    assert code == 130, err
    assert "Traceback" not in err and "error:" not in err, err
    assert [line for line in err.splitlines() if "interrupted" in line] == ["interrupted"]

    # `fourfold train RUN_DIR` resumes from the SIGTERM checkpoint, to the same weights
    resumed = _start(["run"], tmp_path)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"continuing from run/checkpoints/step_{step:08d}" in err
    ours = load_file(str(run / "model.safetensors"))
    theirs = load_file(str(tmp_path / "reference" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch_equal(ours[name], theirs[name]), name


def torch_equal(a: "torch.Tensor", b: "torch.Tensor") -> bool:  # noqa: F821
    import torch

    return bool(torch.equal(a, b))


@pytest.mark.parametrize("argv", [
    ["train", "--set", "model.dim=abc"],
    ["train", "--set", "train.bogus=1"],
    ["train", "missing.toml"],
    ["train", "--resume", "--out", "nowhere"],
])
def test_config_mistakes_are_reported_before_torch_is_imported(argv: list[str], tmp_path: Path):
    import subprocess
    import sys

    from conftest import outside_job_env

    probe = ("import sys; from fourfold.cli import main; code = main(sys.argv[1:]); "
             "print('torch' in sys.modules); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], cwd=tmp_path, text=True,
                          capture_output=True, env=outside_job_env(), timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stdout.strip() == "False"
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: ")


def test_the_vocabulary_defaults_to_the_tokenizers_size(texts: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]):
    from fourfold.train.runs import run_config

    prepare([texts], tmp_path / "bpe", tokenizer="bpe:600", val_fraction=0.1, progress=False)
    from fourfold.data import load_tokenizer

    size = load_tokenizer(tmp_path / "bpe").vocab_size
    assert 512 < size <= 600  # more than the debug preset's 512
    code, err = run_cli(capsys, "train", *sets("train.steps=1", f"data.path={tmp_path / 'bpe'}"),
                        "--out", str(tmp_path / "run"))
    assert code == 0, err
    assert run_config(tmp_path / "run").model.vocab_size == 640  # rounded up to 64
    # a vocabulary the user chose is not changed: too small, refused
    code, err = run_cli(capsys, "train", *sets("train.steps=1", f"data.path={tmp_path / 'bpe'}",
                                               "model.vocab_size=520"),
                        "--out", str(tmp_path / "refused"))
    assert code == 2 and "model.vocab_size = 520 is smaller" in err, err


def test_sigterm_is_noted_once_and_the_old_handlers_come_back():
    import os
    import signal

    from fourfold.signals import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals()
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # noted, the process goes on
        os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing the same signal on
        assert signals.terminated and not signals.interrupted and signals.any
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # a repeat does not cut the unwinding short
        assert signals.interrupted
    finally:
        signals.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_damaged_checkpoint_is_skipped_with_a_one_line_warning(
        run4: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = copy_run(run4, tmp_path)
    (run / "checkpoints" / "step_00000004" / "manifest.json").unlink()
    code, err = run_cli(capsys, "train", str(run), "--set", "train.steps=4")
    assert code == 0, err
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: checkpoint {run}/checkpoints/step_00000004 is damaged (no "
                      "manifest.json); skipping it for the previous one"], err
    assert "continuing from" in err and "step_00000002" in err
