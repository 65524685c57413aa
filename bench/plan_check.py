"""The planner against measurement on this host: for every grid of N ranks, the step time the
planner predicts (the `cpu` machine, calibrated by its matmul probe) beside the step time
measured by training on that grid, and the per-rank parameter + gradient + optimizer memory the
memory model predicts beside what the ranks hold. Prints both, whether each prediction is
within 25% of the measurement, the Spearman rank correlation, and where the fastest measured
grid sits in the planner's ranking (with the measured time of the planner's first choice).

The host's costs are probed inside the job that trains, by its own ranks, once per pass
(`measure_host_costs`, the probe `fourfold plan --machine cpu` runs in a forked job of the
same size): on a shared machine the load changes by the minute, and a cached probe taken under
another load predicts another machine. The grids run round-robin, `--passes` times (default 3,
each a warm-up step and `--steps` timed ones, default 1), so a load that drifts during the run
weighs on every grid alike; the prediction uses the passes' probes combined (compute rates
averaged, collective times by their median). `--repeat K` does K such runs and a summary.
One run of 8 ranks takes about 3-5 minutes on a 2-core host (20 grids x 3 passes x 2 steps,
plus three ~10 s probes), longer when the host is busy.

    python bench/plan_check.py [--nproc 8] [--repeat 3] [--layers 2 --dim 256 --vocab 4096 ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import Table, fail, header, mib, parser  # noqa: E402
from grids import add_model_args, model_config, run_grids_with_probes  # noqa: E402

from fourfold.parallel import GridShape  # noqa: E402
from fourfold.plan.host_probe import calibration_from_probe  # noqa: E402
from fourfold.plan.machine_file import load_machine  # noqa: E402
from fourfold.plan.memory import Precision, predict_param_memory  # noqa: E402
from fourfold.plan.perf import predict_step  # noqa: E402


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for r, i in enumerate(order):
        out[i] = float(r)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def combine(probes: list[dict]) -> dict:
    """One probe from the passes' probes: rates averaged, each collective time the median."""
    n = len(probes)
    comm = {k: [(size, sorted(p["comm"][k][i][1] for p in probes)[n // 2])
                for i, (size, _) in enumerate(probes[0]["comm"][k])] for k in probes[0]["comm"]}
    # every rate the probe measured (matmul, copy, small op, element-wise, loss, attention)
    return {"comm": comm, **{k: sum(p[k] for p in probes) / n for k in probes[0] if k != "comm"}}


def one_run(args: argparse.Namespace) -> dict:
    """Probe, train every grid, print the table; returns the run's summary figures."""
    start = time.perf_counter()
    cfg = model_config(args)
    rows, probes = run_grids_with_probes(args)
    rows = [r for r in rows if r["ok"]]
    cpu = load_machine("cpu")
    cal = calibration_from_probe(combine(probes), args.nproc, args.nproc, cpu.gpus_per_node,
                                 cpu.device.gemm_half_dim)
    machine = cpu.calibrated(cal)
    precision = Precision.of(args.dtype)
    for r in rows:
        shape = GridShape(*r["grid"])
        r["pred_s"] = predict_step(cfg, shape, args.batch, args.seq, 1,
                                   args.activation_checkpointing, machine, precision).step_s
        r["pred_mem"] = sum(predict_param_memory(cfg, shape).values())
    measured = [r["step_s"] for r in rows]
    predicted = [r["pred_s"] for r in rows]
    planner_order = sorted(rows, key=lambda r: r["pred_s"])
    fastest = min(rows, key=lambda r: r["step_s"])
    print(f"probed in the job: {cal.flops_per_rank / 1e9:.1f} GFLOP/s, "
          f"{cal.bytes_per_s_per_rank / 1e9:.2f} GB/s, {cal.op_overhead_s * 1e6:.0f} us/op "
          "per rank\n")
    table = Table("grid (data z y x)", "measured s", "predicted s", "predicted / measured",
                  "within 25%", "measured rank", "planner rank", "state MiB", "planner MiB",
                  "state error")
    mrank, prank = ranks(measured), ranks(predicted)
    within = 0
    for i, r in enumerate(rows):
        mem = sum(r["mem"].values())
        ratio = r["pred_s"] / r["step_s"]
        ok = abs(ratio - 1) <= 0.25
        within += ok
        table.row(" ".join(map(str, r["grid"])), f"{r['step_s']:.3f}", f"{r['pred_s']:.3f}",
                  f"{ratio:.2f}", "yes" if ok else "no", int(mrank[i]) + 1, int(prank[i]) + 1,
                  mib(mem, 2), mib(r["pred_mem"], 2), f"{(r['pred_mem'] - mem) / mem:+.1%}")
    position = planner_order.index(fastest) + 1
    rho = spearman(measured, predicted)
    seconds = time.perf_counter() - start
    print(f"\nSpearman rank correlation {rho:.2f}; the fastest measured grid "
          f"{' '.join(map(str, fastest['grid']))} is the planner's choice #{position}; "
          f"{within} of {len(rows)} grids predicted within 25% ({seconds:.0f} s)\n", flush=True)
    return {"rho": rho, "position": position, "first": planner_order[0]["step_s"],
            "best": fastest["step_s"], "within": within, "grids": len(rows), "s": seconds}


def main() -> None:
    ap = parser(__doc__)
    add_model_args(ap)
    ap.add_argument("--repeat", type=int, default=1, help="runs, each probing afresh")
    ap.set_defaults(passes=3, steps=1, probe=True)
    args = ap.parse_args()
    args.probe = True  # the prediction needs the job's own probe
    if args.repeat < 1:
        fail(f"--repeat {args.repeat}: must be at least 1")
    header("The planner against measurement: step time and memory of every grid",
           f"{args.nproc} ranks, {args.layers} layers x {args.dim}, vocabulary {args.vocab}, "
           f"batch {args.batch} x {args.seq}, {args.dtype}, the `cpu` machine probed by the job")
    runs = [one_run(args) for _ in range(args.repeat)]
    if args.repeat > 1:
        table = Table("run", "Spearman", "fastest grid is the planner's #", "first choice s",
                      "best s", "within 25%", "run s")
        for k, r in enumerate(runs, 1):
            table.row(k, f"{r['rho']:.2f}", r["position"], f"{r['first']:.3f}",
                      f"{r['best']:.3f}", f"{r['within']}/{r['grids']}", f"{r['s']:.0f}")


if __name__ == "__main__":
    main()
