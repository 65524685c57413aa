"""Run by torchrun from test_shard_build.py: a streamed export whose writer (rank 0) is slow.
The job's collectives time out after FOURFOLD_EXPORT_TIMEOUT_S; rank 0's write of the first
and of the last tensor each take FOURFOLD_EXPORT_SLOW_S, longer than that. The other ranks
must wait for the writer without a collective that times out, and leave the export only once
the file is complete: each then checks the file (a one-process export's bytes) and every rank
takes part in one more collective. Prints one JSON line per rank."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold import safetensors_stream
from fourfold.config import ParallelConfig, model_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, init_distributed, leave_job, parallelize
from fourfold.train.runs import save_weights_streamed


def main() -> None:
    timeout_s = float(os.environ["FOURFOLD_EXPORT_TIMEOUT_S"])
    slow_s = float(os.environ["FOURFOLD_EXPORT_SLOW_S"])
    out = Path(os.environ["FOURFOLD_EXPORT_OUT"])
    rank, world, device = init_distributed("gloo", timeout_s=timeout_s)
    shape = GridShape(*json.loads(os.environ["FOURFOLD_EXPORT_SHAPE"]))
    grid = Grid.build(shape, device, timeout_s=timeout_s)
    cfg = model_config("debug")
    pmodel = parallelize(build_model(cfg, seed=5), grid,
                         ParallelConfig(x=shape.x, y=shape.y, z=shape.z, data=shape.data))
    count = sum(1 for s in pmodel.full_tensor_specs()  # the tensors the file holds
                if not (cfg.tie_embeddings and s.name == "output.weight"))
    writes = [0]
    raw_bytes = safetensors_stream._raw_bytes

    def slow_raw_bytes(tensor: torch.Tensor) -> memoryview:
        writes[0] += 1
        if writes[0] in (1, count):  # the first tensor, and the last before the file closes
            time.sleep(slow_s)
        return raw_bytes(tensor)

    safetensors_stream._raw_bytes = slow_raw_bytes
    started = time.perf_counter()
    path = out / "model.safetensors"
    save_weights_streamed(pmodel, path, cfg.tie_embeddings)
    left = time.perf_counter() - started
    complete = path.is_file()  # every rank leaves the export once the file is in place
    single = out / f"single{rank}.safetensors"
    safetensors_stream._raw_bytes = raw_bytes
    save_weights_streamed(parallelize(build_model(cfg, seed=5), Grid.single()), single,
                          cfg.tie_embeddings)
    same = complete and path.read_bytes() == single.read_bytes()
    flag = torch.ones(1)
    dist.all_reduce(flag)  # a collective after the export: nothing left waiting in gloo
    # one write of the whole line: print writes the text and its newline apart, and the
    # ranks share one pipe, so two ranks' lines could run together
    line = json.dumps({"rank": rank, "complete": complete, "same": same, "left_s": left,
                       "after": int(flag.item()), "writes": writes[0] if rank == 0 else None})
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    dist.barrier()
    leave_job(0)


if __name__ == "__main__":
    sys.exit(main())
