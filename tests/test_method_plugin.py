"""A training method is one plug-in: a toy method declared, implemented and modelled in this
file alone (its options, its TrainingMethod, its planner model, one MethodSpec registered
under one key) is checked by the config, planned by the planner, and trained by the trainer
on a 2-rank grid as on one process. Run as a script, this file is that grid's rank."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fourfold.config import ConfigError, ModelConfig, TrainConfig, load_config
from fourfold.methods import MethodOptions, MethodSpec, method_names, register_method
from fourfold.methods.base import positive
from fourfold.parallel.grid import GridShape
from fourfold.plan.memory import Precision
from fourfold.plan.methods import MethodCost, MethodModel, MethodState
from fourfold.plan.perf import Rates
from fourfold.plan.schedule import local_param_numel
from fourfold.train.methods.base import (PhaseHooks, StepData, StepGuard, StepResult,
                                         TrainingMethod, backward_pass, check_meta,
                                         param_views, reduce_loss)


@dataclass
class ScaledSGDOptions(MethodOptions):
    scale: float = 0.5  # the step is scale x lr x the gradient

    def check(self, train: TrainConfig) -> None:
        positive("scale", self.scale)


class ScaledSGD(TrainingMethod):
    """Plain SGD on every trainable shard after a backward, its step scaled by an option."""

    name = "scaled_sgd"

    def __init__(self, pmodel: Any, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> None:
        options = cfg.options()
        assert isinstance(options, ScaledSGDOptions)
        self.scale = options.scale
        self.views = param_views(pmodel, tied_output)

    def step(self, pmodel: Any, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        loss = reduce_loss(pmodel, backward_pass(pmodel, data))
        reason = guard.check(loss, None) if guard is not None else None
        with torch.no_grad():
            for v in self.views:
                if reason is None and v.param.grad is not None:
                    v.param.add_(v.param.grad, alpha=-self.scale * lr)
                v.param.grad = None
        return StepResult(loss, math.nan, reason is not None, reason or "")

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"kind": self.name}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)


class ScaledSGDModel(MethodModel):
    """Every gradient at once, no state, an update that reads the gradients once."""

    time_note = "step time: forward + backward and a plain SGD update"

    def state(self, model: ModelConfig, shape: GridShape, train: TrainConfig,
              precision: Precision) -> MethodState:
        return MethodState(sum(local_param_numel(model, shape).values()) * precision.grad_bytes,
                           0)

    def cost(self, model: ModelConfig, shape: GridShape, train: TrainConfig, rates: Rates,
             precision: Precision) -> MethodCost:
        numel = sum(local_param_numel(model, shape).values())
        return MethodCost(0, 1, numel * (2 * precision.param_bytes + precision.grad_bytes)
                          / rates.bytes_per_s)


SCALED_SGD = MethodSpec("scaled_sgd", ScaledSGDOptions, ScaledSGD, ScaledSGDModel(),
                        weight_decay=0.0)
register_method(SCALED_SGD)

SETS = ["model.preset=debug", "train.optimizer=scaled_sgd", "train.method.scale=0.5",
        "train.lr=0.05", "train.batch_size=8", "train.seq_len=32", "train.steps=4",
        "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=0",
        "train.sample_tokens=0", "train.log_every=1"]


def test_the_config_and_the_planner_know_a_registered_method(tmp_path: Path) -> None:
    from fourfold.plan import load_machine, plan

    assert "scaled_sgd" in method_names()
    cfg = load_config(None, SETS)
    assert cfg.train.options() == ScaledSGDOptions(scale=0.5)
    assert cfg.train.effective_weight_decay() == 0.0
    with pytest.raises(ConfigError, match=r"train\.method\.scale = -1\.0: must be a positive"):
        load_config(None, [*SETS, "train.method.scale=-1"])
    cfg.save(tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml").train.options() == cfg.train.options()
    result = plan(cfg.model, 2, load_machine("perlmutter"), 8, 32, "float32", train=cfg.train)
    assert result.time_note == ScaledSGDModel.time_note
    assert result.best.memory.optimizer == 0 and result.best.memory.grads > 0


def test_method_options_are_checked_before_torch_is_imported() -> None:
    """The declarations (fourfold.methods) are torch-free: a config with a method's options,
    and a mistake in them, is read without importing torch (a fresh interpreter)."""
    program = ("import sys\n"
               "from fourfold.config import ConfigError, load_config\n"
               "load_config(None, ['train.optimizer=galore', 'train.method.rank=8'])\n"
               "try:\n"
               "    load_config(None, ['train.optimizer=es', 'train.method.population=1'])\n"
               "except ConfigError as e:\n"
               "    print(e)\n"
               "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", program], check=True, capture_output=True,
                         text=True).stdout.splitlines()
    assert out == ["train.method.population = 1: must be at least 2 (a member's fitness is "
                   "relative to the population's)", "False"]


@pytest.mark.ranks
@pytest.mark.usefixtures("one_thread")
def test_a_registered_method_trains_on_a_grid_as_on_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import outside_job_env

    from fourfold.train import train

    env = outside_job_env(FOURFOLD_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    grid = [*SETS, "parallel.z=2"]
    launch = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", __file__, str(tmp_path / "grid"), json.dumps(grid)],
        env=env, capture_output=True, text=True, timeout=600)
    assert launch.returncode == 0, launch.stderr[-3000:]
    grid_losses = json.loads((tmp_path / "grid" / "losses.json").read_text())

    monkeypatch.setenv("FOURFOLD_CACHE", env["FOURFOLD_CACHE"])
    single = train(load_config(None, SETS), tmp_path / "single", progress=False)
    assert len(grid_losses) == 4 and single.losses[-1] < single.losses[0]
    torch.testing.assert_close(torch.tensor(grid_losses), torch.tensor(single.losses),
                               rtol=1e-5, atol=0)


if __name__ == "__main__":  # one rank of the grid run
    from fourfold.parallel import leave_job
    from fourfold.train import train

    out = Path(sys.argv[1])
    result = train(load_config(None, json.loads(sys.argv[2])), out, progress=False)
    if torch.distributed.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps(result.losses))
    leave_job(0)
