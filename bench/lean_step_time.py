"""The planner's step time of each training method against the step measured on this host.

Each method trains the same model (float32, activation checkpointing on, one process, or with
--grid an x by y grid of gloo ranks under torchrun) for a few steps in a fresh process (job),
which then probes this host's costs the way `fourfold plan --machine cpu` does (collectives,
matmul, copy, element-wise, noise, loss and attention rates, in the same processes and with
the same threads as the steps they just ran: on a shared machine the load changes by the
minute). The planner's `predict_step`, calibrated by all runs' probes combined, with the
method's `train` config (plan/perf.py `method_cost`) is printed beside the
median of the steps after the first (each method's fastest of --repeat runs, made
round-robin), with the error and each method's time as a multiple of AdamW's, measured and
predicted. GaLore refreshes its projection in the first, untimed step; the prediction spreads
one refresh over galore_gap (200) steps, a few percent at most here. BlockLLM selects at every
step, the planner's step (an upper bound: at block_patience = 1 most steps select).

    python bench/lean_step_time.py [--grid XxY] [--preset 15m] [--steps 6] [--batch 4] [--seq 256]
        [--population 4] [--repeat 3] [--methods adamw lomo ...] [--set METHOD:train.KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from lean_quality import parse_extra  # noqa: E402  METHOD:SECTION.KEY=VALUE
from plan_check import combine  # noqa: E402  the probes of several runs as one
from memory_lean import (METHODS, check_sets, method_sets, parse_grid,  # noqa: E402
                         train_config)


def host_grid(shape: Any, folder: str) -> Any:
    """This process's grid of `shape` (a GridShape) over gloo: under torchrun, this rank of it
    with one thread, as the launcher gives each of several ranks on one host; alone, a one-rank
    gloo group of its own (its store in `folder`), so that barriers and probes work alike."""
    import torch
    import torch.distributed as dist

    from fourfold.parallel import Grid, init_distributed

    if shape.size > 1:
        torch.set_num_threads(1)
        _, _, device = init_distributed("gloo", timeout_s=600)
        return Grid.build(shape, device)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
    return Grid.single()


def launch(script: str, spec: str, ranks: int, what: str,
           env: dict[str, str] | None = None) -> dict:
    """Run `script --rank-worker spec` in a fresh process, or under torchrun as `ranks` gloo
    ranks (one thread each), with `env` added; the JSON row that rank 0 printed last."""
    cmd = [sys.executable, script, "--rank-worker", spec]
    if ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(ranks)]
    env = {**os.environ, **(env or {}), **({"OMP_NUM_THREADS": "1"} if ranks > 1 else {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        sys.exit(f"error: {what} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def report(row: dict) -> None:
    """A rank worker's end: rank 0 (or the one process, its group gone) prints its row; a
    grid's ranks then leave together."""
    import torch.distributed as dist

    from fourfold.parallel import leave_job

    if not dist.is_initialized():
        print(json.dumps(row), flush=True)
        return
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
    dist.barrier()
    leave_job(0)


def child(preset: str, method: str, steps: int, batch: int, seq: int, population: int,
          sets: tuple[str, ...], grid: tuple[int, int] = (1, 1)) -> dict:
    """Train `method` for `steps` steps here (on a grid: this rank of an x by y grid, under
    torchrun), probe the host; this rank's row (the probe merged over the ranks)."""
    import tempfile

    import torch
    import torch.distributed as dist

    from fourfold.config import ParallelConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import GridShape, parallelize
    from fourfold.plan.host_probe import measure_host_costs, merge_rank_probes, probe_groups
    from fourfold.train.host_memory import keep_freed_host_memory
    from fourfold.train.methods import StepData, build_method

    keep_freed_host_memory()  # as `fourfold train` runs on a CPU: no page faults per step
    x, y = grid
    shape = GridShape(y=y, x=x)
    tmp = tempfile.TemporaryDirectory()
    the_grid = host_grid(shape, tmp.name)
    model = build_model(model_config(preset), seed=0, device="meta")
    model.activation_checkpointing = True
    pmodel = parallelize(model, the_grid, ParallelConfig(x=x, y=y), optimizer=method)
    cfg = train_config(method, seq, population, sets)
    trainer = build_method(pmodel, cfg)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        # x and y split the weights, not the batch: every rank sees all of it
        tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g)
        if method == "blockllm":  # the planner's step: a selection, every step
            trainer.selecting_next = True
        dist.barrier()
        start = time.perf_counter()
        trainer.step(pmodel, StepData.one_batch(pmodel, tokens), cfg.lr)
        dist.barrier()
        times.append(time.perf_counter() - start)
    world = dist.get_world_size()
    parts = [None] * world
    dist.all_gather_object(parts, measure_host_costs(probe_groups(world) if world > 1 else {}))
    timed = sorted(times[1:])
    row = {"measured_s": timed[len(timed) // 2], "first_s": times[0],
           "probe": merge_rank_probes(parts), "threads": torch.get_num_threads()}
    if shape.size == 1:
        dist.destroy_process_group()
    tmp.cleanup()
    return row


def predict(args: argparse.Namespace, method: str, probe: dict) -> float:
    """The planner's step for `method` on the cpu machine calibrated by `probe`."""
    from fourfold.config import model_config
    from fourfold.parallel import GridShape
    from fourfold.parallel.embedding import resolve_output_loss
    from fourfold.plan.host_probe import calibration_from_probe
    from fourfold.plan.machine_file import load_machine
    from fourfold.plan.memory import Precision
    from fourfold.plan.perf import predict_step

    x, y = args.grid
    world = x * y
    cpu = load_machine("cpu")
    cal = calibration_from_probe(probe, world, world, cpu.gpus_per_node,
                                 cpu.device.gemm_half_dim)
    return predict_step(model_config(args.preset), GridShape(y=y, x=x), args.batch, args.seq, 1,
                        True, cpu.calibrated(cal), Precision.of("float32"),
                        output_loss=resolve_output_loss("auto", method),
                        train=train_config(method, args.seq, args.population,
                                           method_sets(args, method))).step_s


def measure(args: argparse.Namespace, method: str) -> dict:
    """One row: a fresh process, or one torchrun launch of x * y gloo ranks (rank 0's row)."""
    x, y = args.grid
    spec = json.dumps([args.preset, method, args.steps, args.batch, args.seq, args.population,
                       method_sets(args, method), [x, y]])
    return launch(__file__, spec, x * y, method)


def rank_worker(spec: str) -> None:
    preset, method, steps, batch, seq, population, sets, grid = json.loads(spec)
    report(child(preset, method, steps, batch, seq, population, tuple(sets), tuple(grid)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="15m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--population", type=int, default=4, help="ES members per step")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each method, round-robin; the fastest is shown")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--set", dest="extra", action="append", type=parse_extra, default=[],
                    metavar="METHOD:train.KEY=VALUE", help="a method's extra train key")
    ap.add_argument("--grid", default="1x1", metavar="XxY",
                    help="x by y gloo ranks under torchrun (data = z = 1)")
    ap.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    ap.set_defaults(dtype="float32")  # its runs and planner are float32 (memory_lean's method_sets)
    args = ap.parse_args()
    if args.rank_worker:
        rank_worker(args.rank_worker)
        return
    args.grid = parse_grid(args.grid)
    if args.steps < 2:
        sys.exit("error: --steps must be at least 2 (the first step is not timed)")
    check_sets(args)
    methods = list(dict.fromkeys(["adamw", *args.methods]))
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.repeat):  # round-robin: a load that drifts weighs on every method
        for m in methods:
            runs[m].append(measure(args, m))
    # each method's fastest run (load only ever slows a run down), the probes of all runs
    rows = {m: min(rs, key=lambda r: r["measured_s"]) for m, rs in runs.items()}
    # one calibration for every row: the runs' probes combined as bench/plan_check.py combines
    # its passes' (rates averaged, collective times by their median), so the predicted ratios
    # compare methods, not probes
    probes = [r["probe"] for rs in runs.values() for r in rs]
    probe = combine(probes)
    for m, r in rows.items():
        r["predicted_s"] = predict(args, m, probe)
    ref = rows["adamw"]
    first = next(iter(rows.values()))
    where = ("one process" if args.grid == (1, 1) else
             f"grid x = {args.grid[0]}, y = {args.grid[1]} (gloo ranks, rank 0's steps)")
    print(f"preset {args.preset}, float32, batch {args.batch} x {args.seq}, activation "
          f"checkpointing, {where} ({first['threads']} threads each); the planner calibrated by "
          f"the runs' probes combined (matmul {probe['matmul_flops'] / 1e9:.0f} GFLOP/s, "
          f"min {min(p['matmul_flops'] for p in probes) / 1e9:.0f}, "
          f"max {max(p['matmul_flops'] for p in probes) / 1e9:.0f})")
    print("| method | measured step | planner | error | measured / adamw | planner / adamw |")
    print("|---|---|---|---|---|---|")
    for m, r in rows.items():
        print(f"| {m} | {r['measured_s']:.3f} s | {r['predicted_s']:.3f} s | "
              f"{r['predicted_s'] / r['measured_s'] - 1:+.0%} | "
              f"{r['measured_s'] / ref['measured_s']:.2f} | "
              f"{r['predicted_s'] / ref['predicted_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
