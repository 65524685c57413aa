"""Checkpoints inside the trainer: stop and resume logs the same losses bit for bit,
rollback and skip on bad steps (NaN, spikes), a Hugging Face start, and recovery from a rank
killed with SIGKILL at a chosen step under `fourfold train --nproc 4 --max-restarts 1`."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fourfold.config import Config, load_config
from fourfold.train import Trainer, TrainingError
from fourfold.train.checkpoint import list_checkpoints
from fourfold.train.metrics import read_metrics

from conftest import outside_job_env


pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py


OVERRIDES = ["model.preset=debug", "train.batch_size=8", "train.seq_len=32", "train.steps=6",
             "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=0",
             "train.sample_tokens=0", "train.log_every=1"]


def small_config(*overrides: str) -> Config:
    return load_config(None, [*OVERRIDES, *overrides])


def losses_by_step(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")
            if "loss" in r and not r.get("skipped")}


def _poison_once(trainer: Trainer, bad_step: int) -> None:
    """NaN logits in the forward pass of optimizer step `bad_step`, the first time only."""
    done: list[bool] = []

    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if trainer.step + 1 == bad_step and not done:
            done.append(True)
            return output * math.nan
        return output

    trainer.pmodel.module.norm.register_forward_hook(hook)


@pytest.mark.slow
def test_stop_and_resume_logs_the_same_losses(tmp_path: Path) -> None:
    cfg = small_config("checkpoint.every=3", "train.eval_every=3", "train.eval_batches=1")
    whole = Trainer(cfg, tmp_path / "whole", progress=False).fit()

    stopped = Trainer(cfg, tmp_path / "stopped", progress=False)
    for _ in range(3):
        stopped.train_step()
    stopped.save_checkpoint()
    stopped.train_step()  # work after the checkpoint is lost, as in a crash
    stopped.checkpoints.close()
    del stopped

    resumed_trainer = Trainer(cfg, tmp_path / "stopped", progress=False)
    assert resumed_trainer.step == 3 and resumed_trainer.loader.batches_drawn == 3
    resumed = resumed_trainer.fit()
    assert resumed.losses[-3:] == whole.losses[3:]  # bit for bit
    assert resumed.val_losses[-1] == whole.val_losses[-1]
    logged = losses_by_step(tmp_path / "stopped")
    assert [logged[s] for s in (4, 5, 6)] == whole.losses[3:]
    events = [r for r in read_metrics(tmp_path / "stopped" / "metrics.jsonl") if "event" in r]
    assert events[0]["event"] == "resume" and events[0]["step"] == 3
    # the final weights are the same too
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "stopped" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # checkpoint.every = 3 over 6 steps: two checkpoints, the newest last
    assert [p.name for p in list_checkpoints(tmp_path / "whole")] == ["step_00000006",
                                                                       "step_00000003"]



@pytest.mark.slow
@pytest.mark.parametrize("optimizer, extra", [
    ("lomo", ["train.method.clip_mode=none"]), ("adalomo", []),
    ("mezo", ["train.lr=1e-4", "train.grad_clip=0"]),
    ("blockllm", ["train.method.sparsity=0.5", "train.method.patience=1"]),
    ("galore", ["train.method.gap=2"]),
    ("es", ["train.lr=1e-4", "train.grad_clip=0", "train.method.population=4"])])
def test_memory_lean_methods_train_and_resume_exactly(tmp_path: Path, optimizer: str,
                                                      extra: list[str]) -> None:
    """fourfold train drives train.optimizer = lomo / adalomo / mezo / blockllm / galore / es
    through its update seam;
    the method's state is a checkpoint part: stopped and resumed, the run goes on bit for bit."""
    cfg = small_config(f"train.optimizer={optimizer}", *extra, "checkpoint.every=3")
    whole = Trainer(cfg, tmp_path / "whole", progress=False)
    assert whole.method.name == optimizer and not hasattr(whole.method, "optimizer")
    start = {n: p.detach().clone() for n, p in whole.pmodel.named_parameters()}
    result = whole.fit()
    assert all(math.isfinite(x) for x in result.losses) and len(result.losses) == 6
    moved = max(float((p.detach() - start[n]).abs().max())
                for n, p in whole.pmodel.named_parameters())
    assert moved > 0, f"{optimizer} changed no weight"

    stopped = Trainer(cfg, tmp_path / "stopped", progress=False)
    for _ in range(3):
        stopped.train_step()
    stopped.save_checkpoint()
    stopped.train_step()  # lost, as in a crash
    stopped.checkpoints.close()
    del stopped
    resumed = Trainer(cfg, tmp_path / "stopped", progress=False)
    assert resumed.step == 3
    assert resumed.fit().losses[-3:] == result.losses[3:]  # bit for bit


def test_resume_with_another_schedule_says_so(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The schedule is a checkpoint part: a run resumed with longer training follows its new
    config (the learning rate is a function of the step) and names what changed."""
    Trainer(small_config("checkpoint.every=2", "train.steps=2"), tmp_path, progress=False).fit()
    capsys.readouterr()
    longer = small_config("checkpoint.every=2", "train.steps=4")
    resumed = Trainer(longer, tmp_path, progress=False)
    assert resumed.step == 2 and resumed.schedule.changed == ["train.steps 2 -> 4"]
    resumed.fit()
    assert "schedule differs from the checkpoint's (train.steps 2 -> 4)" in capsys.readouterr().err

def test_no_resume_starts_over(tmp_path: Path) -> None:
    cfg = small_config("checkpoint.every=2", "train.steps=2")
    Trainer(cfg, tmp_path, progress=False).fit()
    fresh = Trainer(small_config("checkpoint.every=2", "train.steps=2", "checkpoint.resume=false"),
                    tmp_path, progress=False)
    assert fresh.step == 0


def test_nan_rolls_back_to_the_last_checkpoint(tmp_path: Path) -> None:
    cfg = small_config("checkpoint.every=2", "train.nan_policy=rollback",
                       "checkpoint.async=false")
    trainer = Trainer(cfg, tmp_path, progress=False)
    _poison_once(trainer, 5)
    result = trainer.fit()
    assert result.steps == 6 and len(result.losses) == 6
    assert all(math.isfinite(x) for x in result.losses)
    records = read_metrics(tmp_path / "metrics.jsonl")
    rollbacks = [r for r in records if r.get("event") == "rollback"]
    assert len(rollbacks) == 1
    assert rollbacks[0]["step"] == 5 and rollbacks[0]["to_step"] == 4
    assert "loss is nan" in rollbacks[0]["reason"]
    # after the rollback, steps 5 and 6 ran on the next batches (the bad one is not replayed)
    assert trainer.loader.batches_drawn == 7


def test_rollback_without_a_checkpoint_stops(tmp_path: Path) -> None:
    trainer = Trainer(small_config("train.nan_policy=rollback"), tmp_path, progress=False)
    _poison_once(trainer, 2)
    with pytest.raises(TrainingError, match="no checkpoint to roll back to"):
        trainer.fit()


def test_loss_spikes_are_skipped_and_logged(tmp_path: Path) -> None:
    # A threshold below 1 makes every step after the first five a "spike": all are skipped.
    cfg = small_config("train.steps=7", "train.spike_threshold=0.5", "train.nan_policy=skip")
    result = Trainer(cfg, tmp_path, progress=False).fit()
    assert result.skipped_steps == [6, 7]
    skipped = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("skipped")]
    assert [r["step"] for r in skipped] == [6, 7]
    assert all("spike" in r["skip_reason"] for r in skipped)


def test_init_from_takes_the_architecture_from_config_json(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir = tmp_path / "hf"
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config)
    hf.save_pretrained(hf_dir, safe_serialization=True)
    cfg = small_config(f"model.init_from={hf_dir}", "train.steps=1")
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    assert (trainer.cfg.model.dim, trainer.cfg.model.vocab_size) == (64, 320)
    module = trainer.pmodel.module
    assert torch.equal(module.state_dict()["layers.0.attn.q_proj.weight"],
                       hf.state_dict()["model.layers.0.self_attn.q_proj.weight"])


# ---- a rank killed with SIGKILL -------------------------------------------------------------

KILL_OVERRIDES = [*OVERRIDES, "train.steps=8", "train.device=cpu", "parallel.x=2",
                  "parallel.z=2", "checkpoint.every=2"]
KILL_RANK, KILL_AFTER_STEP = 3, 5  # past the checkpoint of step 4, three steps before the end

# Loaded by every Python process of the job (PYTHONPATH): in rank KILL_RANK of the first
# attempt, a torch hook after each optimizer step; after step KILL_AFTER_STEP it notes the
# step and sends the rank SIGKILL, inside the step sequence, so the job cannot finish first.
KILLER = """
import os
if (os.environ.get("RANK") == os.environ["FOURFOLD_TEST_KILL_RANK"]
        and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
    import signal

    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = []

    def kill_after_step(optimizer, args, kwargs):
        steps.append(1)
        if len(steps) == int(os.environ["FOURFOLD_TEST_KILL_AFTER"]):
            with open(os.environ["FOURFOLD_TEST_KILLED"], "w") as f:
                f.write(f"{os.environ['RANK']} {len(steps)}")
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(kill_after_step)
"""


def _train_command(run_dir: Path, *extra: str) -> list[str]:
    sets = [arg for item in KILL_OVERRIDES for arg in ("--set", item)]
    return [sys.executable, "-m", "fourfold", "train", "--nproc", "4", "--out", str(run_dir),
            *sets, *extra]


@pytest.mark.ranks
def test_sigkill_of_one_rank_recovers_to_the_same_weights(tmp_path: Path,
                                                          fourfold_cache: Path) -> None:
    from safetensors.torch import load_file

    from fourfold.data import resolve_data_path

    resolve_data_path("builtin:stdlib", "byte")  # prepared once, before the ranks start
    env = outside_job_env(OMP_NUM_THREADS="1")
    whole = subprocess.run(_train_command(tmp_path / "whole"), env=env, capture_output=True,
                           text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(KILLER)
    killed = tmp_path / "killed.txt"
    run = tmp_path / "killed"
    job = subprocess.run(
        _train_command(run, "--max-restarts", "1"),
        env=dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(inject),
                                                                env.get("PYTHONPATH")])),
                 FOURFOLD_TEST_KILL_RANK=str(KILL_RANK),
                 FOURFOLD_TEST_KILL_AFTER=str(KILL_AFTER_STEP), FOURFOLD_TEST_KILLED=str(killed)),
        capture_output=True, text=True, timeout=300)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-3000:]
    # the rank was killed, at the chosen step, in the middle of the first attempt
    assert killed.read_text() == f"{KILL_RANK} {KILL_AFTER_STEP}", output[-3000:]
    records = read_metrics(run / "metrics.jsonl")
    restarts = [i for i, r in enumerate(records) if r.get("event") == "restart"]
    assert len(restarts) == 1 and records[restarts[0]]["restart_count"] == 1, output[-3000:]
    first_attempt = [r["step"] for r in records[:restarts[0]] if "loss" in r]
    assert max(first_attempt, default=0) <= KILL_AFTER_STEP, first_attempt
    # resumed from the newest checkpoint before the kill, and trained to the end
    assert records[restarts[0]]["step"] == 4
    assert max(losses_by_step(run)) == 8
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(run / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after recovery"
