"""The planner's step time of each training method against the step measured on this host.

Each method trains the same model (float32, activation checkpointing on, one process) for a
few steps in a fresh process, which then probes this host's costs the way `fourfold plan
--machine cpu` does (matmul, copy, element-wise, loss and attention rates, in the same
process and with the same threads as the steps it just ran: on a shared machine the load
changes by the minute). The planner's `predict_step`, calibrated by the mean of the rows'
probes, with the method's `train` config (plan/perf.py `method_cost`) is printed beside the
median of the steps after the first (each method's fastest of --repeat runs, made
round-robin), with the error and each method's time as a multiple of AdamW's, measured and
predicted. GaLore refreshes its projection in the first, untimed step; the prediction spreads
one refresh over galore_gap (200) steps, a few percent at most here.

    python bench/lean_step_time.py [--preset 15m] [--steps 6] [--batch 4] [--seq 256]
        [--population 4] [--repeat 3] [--methods adamw lomo ...] [--set METHOD:train.KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from lean_quality import parse_extra  # noqa: E402  METHOD:SECTION.KEY=VALUE
from memory_lean import METHODS, check_sets, method_sets, train_config  # noqa: E402


def child(preset: str, method: str, steps: int, batch: int, seq: int, population: int,
          sets: tuple[str, ...]) -> dict:
    """Train `method` for `steps` steps here, probe the host, predict; one row."""
    import torch

    from fourfold.config import ParallelConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.plan.machines import measure_host_costs
    from fourfold.train.host_memory import keep_freed_host_memory
    from fourfold.train.methods import StepData, build_method

    keep_freed_host_memory()  # as `fourfold train` runs on a CPU: no page faults per step
    model = build_model(model_config(preset), seed=0, device="meta")
    model.activation_checkpointing = True
    pmodel = parallelize(model, Grid.single(), ParallelConfig(), optimizer=method)
    cfg = train_config(method, seq, population, sets)
    trainer = build_method(pmodel, cfg)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g)

        def losses():
            yield pmodel(tokens[:, :-1], tokens[:, 1:]).mean()

        start = time.perf_counter()
        trainer.step(pmodel, StepData(1, losses), cfg.lr)
        times.append(time.perf_counter() - start)
    import tempfile

    import torch.distributed as dist

    # the probe times its loops between barriers: a one-rank gloo group of its own
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        probe = measure_host_costs({})
        dist.destroy_process_group()
    timed = sorted(times[1:])
    return {"measured_s": timed[len(timed) // 2], "first_s": times[0],
            "probe": probe, "threads": torch.get_num_threads()}


def predict(args: argparse.Namespace, method: str, probe: dict) -> float:
    """The planner's step for `method` on the cpu machine calibrated by `probe`."""
    from fourfold.config import model_config
    from fourfold.parallel import GridShape
    from fourfold.parallel.embedding import resolve_output_loss
    from fourfold.plan.machines import calibration_from_probe, load_machine
    from fourfold.plan.memory import Precision
    from fourfold.plan.perf import predict_step

    cpu = load_machine("cpu")
    cal = calibration_from_probe(probe, 1, 1, cpu.gpus_per_node, cpu.device.gemm_half_dim)
    return predict_step(model_config(args.preset), GridShape(), args.batch, args.seq, 1, True,
                        cpu.calibrated(cal), Precision.of("float32"),
                        output_loss=resolve_output_loss("auto", method),
                        train=train_config(method, args.seq, args.population,
                                           method_sets(args, method))).step_s


def measure(args: argparse.Namespace, method: str) -> dict:
    code = ("import json, sys; sys.path.insert(0, 'bench'); import lean_step_time as m; "
            f"print(json.dumps(m.child({args.preset!r}, {method!r}, {args.steps}, {args.batch}, "
            f"{args.seq}, {args.population}, {tuple(method_sets(args, method))!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode:
        sys.exit(f"error: {method} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    args = ap.parse_args()
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
    # one calibration for every row: the rows' probes averaged (as bench/plan_check.py
    # combines its passes'), so the predicted ratios compare methods, not probes
    probes = [r["probe"] for rs in runs.values() for r in rs]
    probe = {k: sum(p[k] for p in probes) / len(probes) for k in probes[0] if k != "comm"}
    probe["comm"] = {}
    for m, r in rows.items():
        r["predicted_s"] = predict(args, m, probe)
    ref = rows["adamw"]
    first = next(iter(rows.values()))
    print(f"preset {args.preset}, float32, batch {args.batch} x {args.seq}, activation "
          f"checkpointing, one process ({first['threads']} threads); the planner calibrated by "
          f"the mean of the rows' probes (matmul {probe['matmul_flops'] / 1e9:.0f} GFLOP/s, "
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
