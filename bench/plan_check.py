"""The planner against reality on this CPU: for every grid of N ranks, the step time the
planner predicts (the `cpu` machine, calibrated by its matmul probe) beside the step time
measured by training on that grid, and the per-rank parameter + gradient + optimizer memory the
memory model predicts beside what the ranks hold. Prints both, the Spearman rank correlation,
and where the fastest measured grid sits in the planner's ranking.

    python bench/plan_check.py [--nproc 8] [--layers 2 --dim 256 --vocab 4096 --seq 128 --batch 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from grids import add_model_args, model_config, run_grids  # noqa: E402

from fourfold.parallel import GridShape  # noqa: E402
from fourfold.plan.machines import load_machine  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    args = ap.parse_args()
    cfg = model_config(args)
    machine = load_machine("cpu")
    precision = Precision.of("float32")
    rows = [r for r in run_grids(args) if r["ok"]]
    for r in rows:
        shape = GridShape(*r["grid"])
        r["pred_s"] = predict_step(cfg, shape, args.batch, args.seq, 1, False, machine,
                                   precision).step_s
        r["pred_mem"] = sum(predict_param_memory(cfg, shape).values())
    measured = [r["step_s"] for r in rows]
    predicted = [r["pred_s"] for r in rows]
    planner_order = sorted(rows, key=lambda r: r["pred_s"])
    fastest = min(rows, key=lambda r: r["step_s"])
    print(f"{args.nproc} ranks, model {args.layers}x{args.dim} vocab {args.vocab}, "
          f"batch {args.batch} x seq {args.seq}, fp32, machine 'cpu' (probed)")
    print(f"{'data z y x':<11} {'measured s':>10} {'predicted s':>11} {'meas rank':>9} "
          f"{'plan rank':>9} {'mem MiB':>8} {'pred MiB':>8} {'mem err':>7}")
    mrank, prank = ranks(measured), ranks(predicted)
    worst_mem = 0.0
    for i, r in enumerate(rows):
        mem = sum(r["mem"].values())
        err = (r["pred_mem"] - mem) / mem
        worst_mem = max(worst_mem, abs(err))
        print(f"{' '.join(map(str, r['grid'])):<11} {r['step_s']:>10.3f} {r['pred_s']:>11.3f} "
              f"{int(mrank[i]) + 1:>9} {int(prank[i]) + 1:>9} {mem / 2**20:>8.2f} "
              f"{r['pred_mem'] / 2**20:>8.2f} {err:>+7.1%}")
    position = planner_order.index(fastest) + 1
    print(f"Spearman rank correlation (measured vs predicted step time): "
          f"{spearman(measured, predicted):.2f}")
    print(f"fastest measured grid {fastest['grid']} is the planner's choice #{position}; "
          f"planner's first choice {planner_order[0]['grid']} measured "
          f"{planner_order[0]['step_s']:.3f}s vs best {fastest['step_s']:.3f}s")
    print(f"largest memory-model error (params + grads + optimizer): {worst_mem:.1%}")


if __name__ == "__main__":
    main()
