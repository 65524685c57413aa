"""Communication: the bytes each grid axis moves per training step, three ways.

On every grid of N ranks (or --grids), a few steps of a small model: per rank and step, the
bytes the engine's ledger recorded on each axis, the planner's closed-form count
(fourfold.plan.schedule.predict_comm_bytes; the two must agree, the `agree` column) and what
torch.distributed was actually handed (counted by wrapping its collectives,
tests/dist_count.py; the `handed` column differs from the ledger only where a gloo fallback
moved more than the algorithm needs). Beside them: the z all-gathers per step, the step time,
and each rank's parameters + gradients + AdamW state as a multiple of 1/(x*y*z) of one
process's.

    python bench/comm.py [--nproc 8] [--dtype bfloat16] [--reduce-dtype bfloat16]
        [--activation-checkpointing] [--grids 1x2x1x2,2x2x1x1] [--layers 2 --dim 256 ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import Table, header, mib, parser  # noqa: E402
from grids import add_model_args, model_config, run_grids  # noqa: E402

AXES = ("x", "y", "z", "data")


def main() -> None:
    ap = parser(__doc__)
    add_model_args(ap)
    args = ap.parse_args()
    args.count = True

    from fourfold.models import build_model
    from fourfold.parallel import GridShape
    from fourfold.plan.schedule import predict_comm_bytes

    cfg = model_config(args)
    full = build_model(cfg, device="meta", seed=0).num_params()
    single = full * 4 * 4  # float32 parameters + gradients + two AdamW moments
    header("Bytes per step on each grid axis: the engine's ledger, the planner, torch.distributed",
           f"{full / 1e6:.2f}M parameters, batch {args.batch} x {args.seq}, {args.nproc} ranks, "
           f"{args.dtype}, reductions in {args.reduce_dtype}, activation checkpointing "
           f"{'on' if args.activation_checkpointing else 'off'}; MiB per rank per step")
    table = Table("grid (data z y x)", *(f"{a} MiB" for a in AXES), "agree", "handed MiB",
                  "z gathers", "state vs 1/xyz", "step s")
    low = 2 if args.dtype == "bfloat16" else 4
    for r in run_grids(args):
        label = " ".join(str(v) for v in r["grid"])
        if not r["ok"]:
            table.row(label, *["-"] * (len(table.columns) - 2), f"skipped: {r['error']}")
            continue
        d, z, y, x = r["grid"]
        predicted = predict_comm_bytes(
            cfg, GridShape(d, z, y, x), r["micro_tokens"], 1, args.activation_checkpointing,
            act_bytes=low, weight_bytes=low, grad_bytes=2 if args.reduce_dtype == "bfloat16" else 4,
            residual_bytes=4)
        agree = "yes" if all(r["bytes"][a] == predicted[a] for a in AXES) else (
            "NO, planner " + " ".join(mib(predicted[a], 3) for a in AXES))
        handed = sum(r["handed"].values())  # the world's and tensor groups' calls too
        state = sum(r["mem"].values()) / (single / (x * y * z))  # data replicates the model
        table.row(label, *(mib(r["bytes"][a], 3) for a in AXES), agree,
                  mib(handed, 3), r["z_gathers"], f"{state:.3f}x", f"{r['step_s']:.3f}")


if __name__ == "__main__":
    main()
