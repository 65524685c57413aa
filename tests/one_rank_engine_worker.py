"""Run by test_one_rank_engine.py in a process of its own: the debug preset trained on one
process as it is (parallel.engine = "auto"), then through the whole engine on a one-rank grid
("always": a one-rank gloo process group, fourfold's layers and collectives, the data-parallel
buckets, the DTensor checkpoint), then the engine's run again in two parts, the second resumed
from the first's checkpoint. Prints one JSON line: the losses and gradient norms of each run
and what the engine's run was made of."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from dist_count import DistCount  # noqa: E402  (tests/ is this script's directory)

from fourfold.config import load_config
from fourfold.parallel import leave_job
from fourfold.parallel.linear import Linear3D
from fourfold.train import Trainer
from fourfold.train.metrics import read_metrics


def config(engine: str, steps: int, dtype: str):
    return load_config(None, [
        "model.preset=debug", "train.batch_size=8", "train.seq_len=64", f"train.steps={steps}",
        "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=0",
        "train.sample_tokens=0", "train.log_every=1", "checkpoint.every=2",
        "checkpoint.async=false", f"train.dtype={dtype}", f"parallel.engine={engine}"])


def curve(run_dir: Path) -> dict[str, list[float]]:
    steps = [m for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m and "step" in m]
    return {"loss": [m["loss"] for m in steps], "grad_norm": [m["grad_norm"] for m in steps]}


def main() -> None:
    out, dtype = Path(sys.argv[1]), sys.argv[2]
    counter = DistCount().install()  # before the process group exists
    result: dict[str, object] = {}
    Trainer(config("auto", 4, dtype), out / "auto", progress=False).fit()
    result["auto"] = curve(out / "auto")
    assert not dist.is_initialized()

    trainer = Trainer(config("always", 4, dtype), out / "always", progress=False)
    trainer.fit()
    result["always"] = curve(out / "always")
    grid, pmodel = trainer.grid, trainer.pmodel
    ops = {op for op, *_ in counter.records}
    result["made"] = {
        "process_group": dist.is_initialized() and dist.get_world_size() == 1,
        "axis_groups": sorted(a for a in ("x", "y", "z", "data") if grid.group(a) is not None),
        "engine": pmodel.engine is not None,
        "parallel_linears": sum(isinstance(m, Linear3D) for m in pmodel.module.modules()),
        "buckets": len(pmodel.engine.bucketer._buckets) if pmodel.engine else 0,
        "collectives": sorted(ops),
        "checkpoint_mesh": trainer.checkpoints.mesh is not None,
        "ledger": pmodel.ledger.snapshot(),
    }
    # the same run in two parts: the second resumes from the first's step-2 checkpoint
    Trainer(config("always", 2, dtype), out / "parts", progress=False).fit()
    Trainer(config("always", 4, dtype), out / "parts", progress=False).fit()
    result["resumed"] = curve(out / "parts")
    print(json.dumps(result), flush=True)
    leave_job(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
