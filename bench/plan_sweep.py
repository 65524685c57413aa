"""Weak-scaling sweep of the planner: predicted throughput of GPT-style models growing with the
GPU count, each on its best 4D grid, for machine presets. Prints one table per machine.

    python bench/plan_sweep.py [--machines perlmutter frontier ...] [--max-gpus 1024]
                               [--params-per-gpu 5e8] [--seq 2048] [--plot-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import time

from fourfold.plan import PlanError, load_machine
from fourfold.plan.sweep import format_sweep, gpu_counts, plot_sweep, run_sweep


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machines", nargs="+", default=["perlmutter", "frontier", "alps",
                                                     "dgx-h100"])
    p.add_argument("--max-gpus", type=int, default=1024)
    p.add_argument("--params-per-gpu", type=float, default=5e8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--sequences-per-gpu", type=int, default=4)
    p.add_argument("--plot-dir", help="also write plan_sweep_<machine>.png here")
    args = p.parse_args(argv)
    try:
        for name in args.machines:
            machine = load_machine(name)
            start = time.perf_counter()
            rows = run_sweep(machine, gpu_counts(args.max_gpus, machine.gpus_per_node),
                             args.params_per_gpu, args.seq, args.sequences_per_gpu, "bfloat16")
            print(format_sweep(rows, machine))
            print(f"({time.perf_counter() - start:.1f} s to plan {len(rows)} GPU counts)")
            if args.plot_dir:
                path = plot_sweep(rows, machine, f"{args.plot_dir}/plan_sweep_{name}.png")
                print(f"plot: {path}")
            print()
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
