"""Bytes moved per optimizer step per axis on every grid of N ranks: measured by the engine's
ledger beside the planner's closed-form count (they must agree), and the per-rank memory of
parameters + gradients + optimizer state against 1/(x*y*z) of the single-process figure.

    python bench/comm.py [--nproc 8] [--layers 2 --dim 256 --vocab 4096 --seq 128 --batch 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from grids import add_model_args, model_config, run_grids  # noqa: E402

from fourfold.parallel import GridShape  # noqa: E402
from fourfold.plan.schedule import predict_comm_bytes  # noqa: E402


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    args = ap.parse_args()
    cfg = model_config(args)
    rows = run_grids(args)
    from fourfold.models import build_model
    full = build_model(cfg).num_params()
    single = full * 4 * 4  # fp32 params + grads + two AdamW states
    print(f"model: {full / 1e6:.2f}M params, batch {args.batch} x seq {args.seq}, "
          f"{args.nproc} ranks; bytes per step per rank in MiB (measured / predicted)")
    print(f"{'data z y x':<11} {'x':>17} {'y':>17} {'z':>17} {'data':>17} {'agree':>5} "
          f"{'mem/rank MiB':>12} {'vs 1/xyz':>8} {'step s':>7}")
    for r in rows:
        label = " ".join(str(v) for v in r["grid"])
        if not r["ok"]:
            print(f"{label:<11} skipped: {r['error']}")
            continue
        d, z, y, x = r["grid"]
        pred = predict_comm_bytes(cfg, GridShape(d, z, y, x), r["micro_tokens"], 1, False)
        cells = [f"{mib(r['bytes'][a])}/{mib(pred[a]).strip():>8}" for a in ("x", "y", "z", "data")]
        agree = all(r["bytes"][a] == pred[a] for a in ("x", "y", "z", "data"))
        mem = sum(r["mem"].values())
        share = single / (x * y * z)  # tensor axes split the model; data replicates it
        print(f"{label:<11} {' '.join(cells)} {'yes' if agree else 'NO':>5} {mem / 2**20:>12.2f} "
              f"{mem / share:>7.3f}x {r['step_s']:>7.3f}")


if __name__ == "__main__":
    main()
