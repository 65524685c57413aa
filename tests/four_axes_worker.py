"""Run by torchrun from test_four_axes.py: data, z, y and x split at once. For each grid of
this world size, the checks in FOURFOLD_TEST_CHECKS (one job checks several things: starting
16 ranks on 2 cores costs more than the checks):

  train   a variant of parallel_worker.py (three SGD steps against one process, the ledger
          against what torch.distributed was handed), then a checkpoint of the model and its
          optimizer in $FOURFOLD_TEST_RUN and the gathered weights it holds
  resume  on another grid: that checkpoint loaded (the weights must equal the saved ones),
          then more steps, against one process that ran all of them
  auto    build_run with parallel.auto = true: the grid rank 0's planner chose, as each rank
          built it
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fourfold.config import CheckpointConfig, load_config
from fourfold.parallel import Grid, GridShape, parallelize
from fourfold.train.build import build_run
from fourfold.train.checkpoint import CheckpointManager

from dist_count import DistCount
from grid_cases import run_grid_cases
from parallel_worker import (STEPS, batches, build, compare, make_optimizer, model_cfg,
                             one_process_run, parallel_config, train, train_on_grid)

SAVED_WEIGHTS = "weights_at_save.pt"


def run_dir() -> Path:
    return Path(os.environ["FOURFOLD_TEST_RUN"])


def check_train(shape: GridShape, grid: Grid, check: dict, counter: DistCount) -> dict:
    result, pmodel, opt = train_on_grid(shape, grid, check["variant"], counter)
    manager = CheckpointManager.for_model(run_dir(), CheckpointConfig(keep=1, async_save=False),
                                          grid, pmodel, opt)
    manager.save(STEPS, {"step": STEPS})
    manager.close()
    full = pmodel.full_state_dict()
    if grid.rank == 0:
        torch.save(full, run_dir() / SAVED_WEIGHTS)
    return result


def check_resume(shape: GridShape, grid: Grid, check: dict, counter: DistCount) -> dict:
    variant, more = check["variant"], check["more_steps"]
    cfg = model_cfg(variant)
    ref_losses, ref_state = one_process_run(variant, STEPS + more)
    pmodel = parallelize(build(cfg, variant), grid, parallel_config(shape, variant))
    opt = make_optimizer(pmodel, variant.get("opt", "sgd"))
    manager = CheckpointManager.for_model(run_dir(), CheckpointConfig(), grid, pmodel, opt)
    extra = manager.load(manager.latest_valid())
    saved = torch.load(run_dir() / SAVED_WEIGHTS)
    loaded = pmodel.full_state_dict()
    loaded_diff = max(float((loaded[k] - saved[k]).abs().max()) for k in saved)
    pmodel.ledger.reset()
    counter.reset()
    data = batches(cfg.vocab_size, variant.get("accum", 1), STEPS + more)[STEPS:]
    losses, memory, without_grad = train(pmodel, opt, data, grid.batch_shard,
                                         variant.get("goldfish", False),
                                         variant.get("bf16", False))
    return dict(ok=True, saved_step=extra["step"], loaded_diff=loaded_diff, memory=memory,
                without_grad=without_grad,
                **compare(pmodel, grid, counter, losses, (ref_losses[STEPS:], ref_state)))


def check_auto(shape: GridShape, grid: Grid, check: dict, counter: DistCount) -> dict:
    run = build_run(load_config(None, check["overrides"]), run_dir() / "auto")
    built, p = run.grid.shape, run.cfg.parallel
    return dict(ok=True, built=[built.data, built.z, built.y, built.x],
                recorded=[p.data, p.z, p.y, p.x])


CHECKS = {"train": check_train, "resume": check_resume, "auto": check_auto}


def main() -> None:
    counter = DistCount().install()  # before the process group exists
    run_grid_cases("FOURFOLD_TEST_CHECKS", "check",
                   lambda shape, grid, check: CHECKS[check["name"]](shape, grid, check, counter))


if __name__ == "__main__":
    main()
