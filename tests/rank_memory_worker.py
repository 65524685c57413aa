"""Peak resident memory of each rank (VmHWM), less the peak of the same process after it has
only imported fourfold. Run by torchrun (or alone, for one process) from test_shard_build.py
and bench/memory.py; rank 0 writes one JSON line per rank.

Modes (FOURFOLD_RANK_MEM_MODE):
  build   build the model as the trainer does (sharded: on the meta device, then parallelize),
          then write model.safetensors by streaming; the numbers: after the build, and peak
  whole   build the whole model on this rank, then parallelize (what the trainer did before
          building in shards)
  train   fourfold's Trainer on the config in FOURFOLD_RANK_MEM_CONFIG (a few steps, a
          checkpoint and the final export)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# the baseline: a process that has imported fourfold, the trainer and what it loads (the
# checkpoint writer pulls in torch.distributed.checkpoint: some 75 MiB)
import fourfold.cli  # noqa: F401
import fourfold.train.checkpoint  # noqa: F401
import fourfold.train.trainer  # noqa: F401
import torch.distributed as dist

from fourfold.config import ModelConfig, ParallelConfig, load_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, init_distributed, leave_job, parallelize


def vm_hwm() -> int:
    """Peak resident set of this process so far, in bytes (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    baseline = vm_hwm()
    mode = os.environ["FOURFOLD_RANK_MEM_MODE"]
    out_path = Path(os.environ["FOURFOLD_RANK_MEM_OUT"])
    record: dict = {"mode": mode, "baseline": baseline}
    if mode == "train":
        from fourfold.train import Trainer

        cfg = load_config(os.environ["FOURFOLD_RANK_MEM_CONFIG"])
        trainer = Trainer(cfg, os.environ["FOURFOLD_RANK_MEM_RUN"], progress=False)
        record["after_build"] = vm_hwm()
        trainer.fit()
        rank, world = trainer.rank, trainer.world_size
        record["grid"] = str(trainer.grid.shape)
    else:
        rank, world, device = init_distributed("gloo", timeout_s=300)
        spec = json.loads(os.environ["FOURFOLD_RANK_MEM_MODEL"])
        cfg = ModelConfig(**spec["model"])
        shape = GridShape(*spec["shape"])
        grid = Grid.build(shape, device)
        pcfg = ParallelConfig(x=shape.x, y=shape.y, z=shape.z, data=shape.data)
        if mode == "whole":
            pmodel = parallelize(build_model(cfg, seed=1), grid, pcfg)
        else:
            pmodel = parallelize(build_model(cfg, seed=1, device="meta"), grid, pcfg)
        record["after_build"] = vm_hwm()
        if mode == "build" and spec.get("export"):
            from fourfold.train.runs import save_weights_streamed

            save_weights_streamed(pmodel, Path(spec["export"]), cfg.tie_embeddings)
        record["grid"] = str(shape)
    record["peak"] = vm_hwm()
    records = [record]
    if world > 1:
        records = [None] * world
        dist.all_gather_object(records, record)
    if rank == 0:
        with open(out_path, "w") as f:
            for r, rec in enumerate(records):
                f.write(json.dumps(dict(rec, rank=r)) + "\n")
    if world > 1:
        dist.barrier()
    leave_job(0)


def launch(nproc: int, mode: str, out: Path, env_extra: dict[str, str],
           timeout_s: float = 900) -> tuple[list[dict] | None, str]:
    """Run this worker on `nproc` ranks; (its JSON lines, or None if the launch failed, and
    the launch's stderr)."""
    env = dict(os.environ, FOURFOLD_RANK_MEM_MODE=mode, FOURFOLD_RANK_MEM_OUT=str(out),
               OMP_NUM_THREADS="1", **env_extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if proc.returncode != 0 or not out.is_file():
        return None, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stderr


if __name__ == "__main__":
    main()
