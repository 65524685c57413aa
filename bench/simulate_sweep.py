"""Every grid of one job, simulated: does the planner accept and reject the grids that the
real code's peak would, how close is its memory, and are its bytes per axis the engine's?

For each grid the planner enumerates for MODEL on WORLD ranks (with the micro-batch,
accumulation and activation checkpointing it picks for that grid), nearest the memory a rank
has first, rank 0 (with --last also the last rank) is built and stepped once under torch's
fake process group and fake tensors (fourfold.simulate), one grid after another in this
process. Each rank starts as a resumed run does, its AdamW state made before the step, so that
one step reaches the peak of every later step (a fresh run makes the state in its first update
and peaks in its second step). A grid that accumulates more than two micro-batches is stepped
with two (the global batch shrunk to match; its bytes compared with the planner's for two),
where the planner's memory is the same for both: later micro-batches repeat the second's
allocations.
"simulated fits" puts the simulated peak of live tensors in the place of the planner's
tensor terms (its host runtime term, none on a GPU, stays) against the memory a rank has.

    python bench/simulate_sweep.py [--model 70b] [--world 1024] [--batch 128] [--seq 8192]
        [--machine dgx-h100] [--last] [--limit N] [--skip N] [--jobs N]
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).parent))

from common import Table, fail, header, parser  # noqa: E402

if TYPE_CHECKING:
    from fourfold.config import Config
    from fourfold.parallel.grid import GridShape
    from fourfold.plan.catalog import Machine

AXES = ("x", "y", "z", "data")
GIB = 2**30


def one_grid(cfg: "Config", shape: "GridShape", machine: "Machine", last: bool) -> dict:
    """Simulate rank 0 (and the last rank) of `shape` once, beside the planner: the figures of
    one row (in a worker process with --jobs)."""
    from fourfold.simulate import planner_tensor_bytes, simulate

    began = time.perf_counter()
    ranks = [0, shape.size - 1] if last else [0]
    stepped = two_micro_batches(cfg, shape, machine)
    reports = simulate(stepped, shape, ranks, machine, steps=1, resumed=True, whole_run=False)
    mem = reports[0].planned_memory
    assert mem is not None
    return {"planned": planner_tensor_bytes(mem), "total": mem.total,
            "peak": max(r.peak for r in reports),
            "same_bytes": all({a: r.step_bytes.get(a, 0) for a in AXES} == r.planned_bytes
                              for r in reports),
            "seconds": time.perf_counter() - began, "stepped": stepped.train.grad_accum}


def two_micro_batches(cfg: "Config", shape: "GridShape", machine: "Machine") -> "Config":
    """cfg with at most two micro-batches a step (the global batch shrunk to match), where
    the planner's memory is the same as with cfg's accumulation: every micro-batch after the
    second repeats its allocations (the gradients exist from the first on), so the step's
    peak is reached by the second, and a step of two costs a fraction of one of sixteen."""
    from fourfold.plan.memory import predicted_memory
    from fourfold.simulate import simulation_config

    t = cfg.train
    if t.grad_accum <= 2:
        return cfg
    fewer = dataclasses.replace(cfg, train=dataclasses.replace(
        t, grad_accum=2, batch_size=t.batch_size // t.grad_accum * 2))

    def planned(c: "Config") -> int:
        return predicted_memory(simulation_config(c, shape), shape,
                                machine.device.shared_host).total

    return fewer if planned(fewer) == planned(cfg) else cfg


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="70b")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=128, help="global batch in sequences")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--machine", default="dgx-h100")
    ap.add_argument("--last", action="store_true", help="simulate the last rank too")
    ap.add_argument("--limit", type=int, default=0,
                    help="the N grids whose planned peak is nearest the memory a rank has "
                    "(0: every grid)")
    ap.add_argument("--skip", type=int, default=0,
                    help="leave out the N grids nearest the memory a rank has (done by a run "
                    "that stopped after them)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="grids simulated at once, each in its own process (one a core)")
    args = ap.parse_args()
    if args.jobs < 1:
        fail(f"--jobs {args.jobs}: must be at least 1")

    from fourfold.config import Config, model_config
    from fourfold.errors import FourfoldError
    from fourfold.plan.machine_file import load_machine
    from fourfold.plan.search import plan

    try:
        machine = load_machine(args.machine)
        model = model_config(args.model)
        result = plan(model, args.world, machine, args.batch, args.seq, "bfloat16")
    except FourfoldError as e:
        fail(str(e))
    # the grids nearest the memory a rank has first, where accepting and rejecting are decided
    # (--limit keeps those)
    usable = machine.usable_memory_bytes(args.world)
    candidates = sorted(result.candidates, key=lambda c: abs(c.memory.total / usable - 1))
    candidates = candidates[args.skip:][:args.limit or None]
    header(f"Does the planner accept the grids the real code fits ({args.model} on "
           f"{args.world} ranks)?",
           f"{len(candidates)} of {len(result.candidates)} grids the planner enumerates "
           f"({len(result.rejected)} cannot split the model); global batch {args.batch} x "
           f"{args.seq}, bfloat16, {machine.name}; per grid the planner's micro-batch, "
           "accumulation and checkpointing; rank 0" + (" and the last rank" if args.last
                                                      else "") + ", one resumed step each; "
           "diff: the planner's tensor terms against the simulated peak")
    jobs = []
    for c in candidates:
        cfg = Config()
        cfg.model = model
        cfg.train = dataclasses.replace(cfg.train, batch_size=args.batch, seq_len=args.seq,
                                        dtype="bfloat16", grad_accum=c.grad_accum,
                                        activation_checkpointing=c.activation_checkpointing)
        cfg.parallel = dataclasses.replace(cfg.parallel, reduce_dtype=c.reduce_dtype,
                                           overlap_forward=c.overlap_forward)
        jobs.append((cfg, c.shape, machine, args.last))
    table = Table("grid", "mb x acc", "AC", "planner fits", "simulated fits", "planner GiB",
                  "simulated GiB", "diff", "bytes = planner", "s")
    agree = equal_bytes = 0
    worst = (0.0, "")
    start = time.perf_counter()
    if args.jobs == 1:
        results = (one_grid(*job) for job in jobs)
    else:
        pool = concurrent.futures.ProcessPoolExecutor(
            args.jobs, mp_context=multiprocessing.get_context("spawn"))
        results = pool.map(one_grid, *zip(*jobs))
    for i, (c, r) in enumerate(zip(candidates, results)):
        print(f"grid {i + 1} of {len(candidates)}: {c.shape}", file=sys.stderr, flush=True)
        planner_fits = r["total"] <= usable
        # the simulated peak in the place of the planner's tensor terms
        simulated_fits = r["peak"] + (r["total"] - r["planned"]) <= usable
        diff = r["planned"] / r["peak"] - 1
        agree += planner_fits == simulated_fits
        equal_bytes += r["same_bytes"]
        if abs(diff) > abs(worst[0]):
            worst = (diff, str(c.shape))
        accumulation = (f"{c.grad_accum}" if r["stepped"] == c.grad_accum
                        else f"{c.grad_accum} ({r['stepped']} stepped)")
        table.row(str(c.shape), f"{c.micro_batch} x {accumulation}",
                  "on" if c.activation_checkpointing else "off",
                  "yes" if planner_fits else "no", "yes" if simulated_fits else "no",
                  f"{r['planned'] / GIB:.2f}", f"{r['peak'] / GIB:.2f}", f"{diff * 100:+.1f}%",
                  "yes" if r["same_bytes"] else "NO", f"{r['seconds']:.0f}")
    print()
    print(f"{len(candidates)} grids in {time.perf_counter() - start:.0f} s: the planner and the "
          f"simulation agree on {agree} accepts and rejects; bytes per axis equal on "
          f"{equal_bytes}; the largest difference {worst[0] * 100:+.1f}% ({worst[1]})")


if __name__ == "__main__":
    main()
