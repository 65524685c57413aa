"""Guards for what only a GPU run would show, checked on the CPU: a checkpoint load that
would fill copies of the weights, step times that stop when the host has queued the work,
and LOMO's norm accumulator off the gradients' device."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fourfold.config import load_config
from fourfold.train import Trainer, trainer as trainer_module
from fourfold.train.checkpoint import CheckpointError, check_wraps_in_place

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py

OVERRIDES = ["model.preset=debug", "train.batch_size=4", "train.seq_len=16",
             "train.warmup_steps=0", "train.eval_every=0", "train.eval_batches=0",
             "train.sample_tokens=0", "train.device=cpu"]


def wrapped(local: torch.Tensor, device_type: str) -> SimpleNamespace:
    """What DTensor.from_local gives, as the check reads it: its local tensor and its mesh."""
    return SimpleNamespace(to_local=lambda: local,
                           device_mesh=SimpleNamespace(device_type=device_type))


def test_a_load_that_would_fill_a_copy_of_the_weights_is_refused() -> None:
    weight = torch.zeros(4, 3)
    check_wraps_in_place(wrapped(weight, "cpu"), weight, "w")  # the target itself
    check_wraps_in_place(wrapped(weight[1:], "cpu"), weight, "w")  # a view of it
    with pytest.raises(CheckpointError, match="holds a copy of the tensor.*cuda mesh"):
        # torch's from_local copies a tensor that is not on the mesh's device
        check_wraps_in_place(wrapped(weight.clone(), "cuda"), weight, "w")


@pytest.mark.slow
def test_step_times_include_the_wait_for_the_device(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that finishes the work later than the host queues it: the wait at the log
    point counts in the steps' time, so tokens/s is not the host's queueing rate."""
    wait_s = 0.4
    original = trainer_module.read_steps

    def slow_device(steps):
        if any(s._host is None for s in steps):
            time.sleep(wait_s)
        original(steps)

    monkeypatch.setattr(trainer_module, "read_steps", slow_device)
    cfg = load_config(None, [*OVERRIDES, "train.steps=4", "train.log_every=2"])
    trainer = Trainer(cfg, tmp_path, progress=False)
    result = trainer.fit()
    assert trainer.train_seconds >= 2 * wait_s, trainer.train_seconds
    assert result.tokens_per_s <= 4 * 4 * 16 / (2 * wait_s)


def test_lomo_accumulates_its_norm_on_the_gradients_device() -> None:
    from fourfold.config import ParallelConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.methods import build_method

    cfg = load_config(None, ["train.optimizer=lomo", "train.method.clip_mode=two_pass"]).train
    grid = Grid.single()
    model = build_model(model_config("debug"), seed=0)
    method = build_method(parallelize(model, grid, ParallelConfig(), blocked_loss=True), cfg)
    assert method._norm_sq.device == grid.device
