"""The loop every multi-rank test worker runs: for each grid of FOURFOLD_TEST_SHAPES that has
this job's world size, each case of the job (a JSON list in an environment variable) is run
by the worker's own function; a case that raises is reported with its traceback (the test
fails with it), the others go on. Every rank reports: rank 0 gathers the results and writes one
JSON line per case and rank to FOURFOLD_TEST_OUT, so a test asserts on every rank's own facts
(its ledger, its shards, its gradients), not on rank 0's alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
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
    "rank": this rank, **run_case(shape, grid, case), "seconds": the case's time, which tells
    where a job's time goes}). Lines come in job order, each case's ranks in rank order. Ends
    the rank (leave_job)."""
    rank, world, device = init_distributed("gloo", timeout_s=120)
    cases = json.loads(os.environ[cases_env])
    results = []
    for shape_list in json.loads(os.environ["FOURFOLD_TEST_SHAPES"]):
        shape = GridShape(*shape_list)
        if shape.size != world:
            continue
        grid = Grid.build(shape, device)
        for case in cases:
            result = {"shape": shape_list, label: case, "rank": rank}
            started = time.perf_counter()
            try:
                result.update(run_case(shape, grid, case))
            except Exception:  # reported to the test, which fails with the traceback
                result.update(ok=False, error=traceback.format_exc())
            result["seconds"] = round(time.perf_counter() - started, 2)
            results.append(result)
    every_rank: list[list[dict]] = [[] for _ in range(world)]
    dist.all_gather_object(every_rank, results)
    if rank == 0:
        with open(os.environ["FOURFOLD_TEST_OUT"], "w") as f:
            for case_results in zip(*every_rank):
                for r in case_results:
                    f.write(json.dumps(r) + "\n")
    dist.barrier()
    leave_job(0)  # destroy the process group, flush, os._exit


def run_counted_variants(run_variant: CountedCase) -> None:
    """run_grid_cases over FOURFOLD_TEST_VARIANTS, each variant also handed the counter of
    what torch.distributed is given (installed before the process group exists)."""
    counter = DistCount().install()
    run_grid_cases("FOURFOLD_TEST_VARIANTS", "variant",
                   lambda shape, grid, variant: run_variant(shape, grid, variant, counter))


def launch_grid_cases(worker: Path, nproc: int, grids: list[list[int]], cases_env: str,
                      label: str, cases: list[dict], out: Path, timeout: int = 600,
                      env: dict[str, str] | None = None) -> list[dict]:
    """The test's side: start `worker` (which calls run_grid_cases) on `nproc` gloo ranks under
    torchrun, with `env` added to the environment, and return its results, one per (grid, case,
    rank), having checked that every rank reported every case of every grid and that no case
    raised."""
    from conftest import outside_job_env  # tests/conftest.py: the test side only

    job_env = outside_job_env(FOURFOLD_TEST_SHAPES=json.dumps(grids), OMP_NUM_THREADS="1",
                              FOURFOLD_TEST_OUT=str(out), PYTHONPATH=str(worker.parent),
                              **{cases_env: json.dumps(cases)}, **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone", str(worker)],
        env=job_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    reported = [(r["shape"], r[label], r["rank"]) for r in results]
    expected = [(shape, case, rank) for shape in grids for case in cases for rank in range(nproc)]
    assert reported == expected, f"{len(reported)} results, {len(expected)} expected"
    for r in results:
        assert r["ok"], f"grid {r['shape']} {label} {r[label]} rank {r['rank']}:\n{r.get('error')}"
    return results
