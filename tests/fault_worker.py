"""Run by torchrun from test_faults.py: rank 1 dies or hangs at the second step; the other
ranks must stop within the timeout with a CollectiveError naming their rank and the axis."""

from __future__ import annotations

import os
import sys
import time

import torch

from fourfold.config import ParallelConfig, model_config
from fourfold.models import build_model
from fourfold.parallel import CollectiveError, Grid, GridShape, init_distributed, parallelize


def main() -> None:
    mode = os.environ["FOURFOLD_FAULT"]  # "die" or "hang"
    timeout = float(os.environ.get("FOURFOLD_FAULT_TIMEOUT", "5"))
    rank, world, device = init_distributed("gloo", timeout_s=timeout)
    grid = Grid.build(GridShape(data=1, z=1, y=1, x=world), device, timeout_s=timeout)
    cfg = model_config("debug")
    pm = parallelize(build_model(cfg, seed=0), grid, ParallelConfig(x=world))
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    start = None
    try:
        for step in range(3):
            if step == 1 and rank == 1:
                if mode == "die":
                    os._exit(3)
                time.sleep(3600)  # hang: the launcher kills us when the others fail
            if step == 1:
                start = time.monotonic()
            loss = pm(tokens[:, :-1], tokens[:, 1:]).mean()
            loss.backward()
            pm.finish_backward()
    except CollectiveError as e:
        elapsed = time.monotonic() - (start or time.monotonic())
        print(f"FAULT-REPORT rank={rank} elapsed={elapsed:.1f} message={e}", flush=True)
        sys.stderr.flush()
        os._exit(17)
    print(f"FAULT-REPORT rank={rank} no error", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
