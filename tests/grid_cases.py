"""The loop every multi-rank test worker runs: for each grid of FOURFOLD_TEST_SHAPES that has
this job's world size, each case of the job (a JSON list in an environment variable) is run
by the worker's own function; a case that raises is reported with its traceback (the test
fails with it), the others go on. Rank 0 writes one JSON line per case to FOURFOLD_TEST_OUT."""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Callable, TypeVar

import torch.distributed as dist

from fourfold.parallel import Grid, GridShape, init_distributed, leave_job
from dist_count import DistCount

RunCase = Callable[[GridShape, Grid, dict], dict]
CountedCase = Callable[[GridShape, Grid, dict, DistCount], dict]
T = TypeVar("T")
_REFERENCES: dict[str, object] = {}


def one_process_reference(case: dict, make: Callable[[], T]) -> T:
    """The one-process run a case is compared with, made once per case and rank: it depends
    on the case alone (its model, data and seeds), not on the grid, and a job runs each case
    on several grids; each rank of a 4- or 8-rank job on 2 cores made it again for every grid.
    The caller must not change what it returns."""
    key = json.dumps(case, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = make()
    return _REFERENCES[key]  # type: ignore[return-value]


def run_grid_cases(cases_env: str, label: str, run_case: RunCase) -> None:
    """Run every (grid, case) of this job; `cases_env` names the variable that holds the cases
    and `label` the key each result carries its case under ({"shape": [...], label: case,
    **run_case(shape, grid, case), "seconds": the case's time}, which tells where a job's time
    goes). Ends the rank (leave_job)."""
    rank, world, device = init_distributed("gloo", timeout_s=120)
    cases = json.loads(os.environ[cases_env])
    results = []
    for shape_list in json.loads(os.environ["FOURFOLD_TEST_SHAPES"]):
        shape = GridShape(*shape_list)
        if shape.size != world:
            continue
        grid = Grid.build(shape, device)
        for case in cases:
            result = {"shape": shape_list, label: case}
            started = time.perf_counter()
            try:
                result.update(run_case(shape, grid, case))
            except Exception:  # reported to the test, which fails with the traceback
                result.update(ok=False, error=traceback.format_exc())
            result["seconds"] = round(time.perf_counter() - started, 2)
            results.append(result)
    if rank == 0:
        with open(os.environ["FOURFOLD_TEST_OUT"], "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    leave_job(0)  # destroy the process group, flush, os._exit


def run_counted_variants(run_variant: CountedCase) -> None:
    """run_grid_cases over FOURFOLD_TEST_VARIANTS, each variant also handed the counter of
    what torch.distributed is given (installed before the process group exists)."""
    counter = DistCount().install()
    run_grid_cases("FOURFOLD_TEST_VARIANTS", "variant",
                   lambda shape, grid, variant: run_variant(shape, grid, variant, counter))
