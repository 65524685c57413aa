"""Simulation at scale: the real build and a two-step run (Trainer.fit) of rank 0 and the
last rank of `70b` on 1,024 ranks and `405b` on 16,384 (bfloat16, sequence 8192, activation
checkpointing, one sequence per batch shard, the planner's grid on dgx-h100), each in a fresh
process under torch's fake process group and fake tensors (fourfold.simulate): the simulated
peak of live tensors against the planner's tensor terms, the bytes per axis against the
planner's, the peaks of the rest of the run through Trainer.fit (a validation, the final
sample, a checkpoint's staging, the streamed export; no tensor written), the wall time and
the process's resident peak.

    python bench/simulate.py [--cases 70b:1024:128,405b:16384:1024] [--machine dgx-h100]
        [--ranks 0,-1]
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import Table, header, parser  # noqa: E402

AXES = ("x", "y", "z", "data")
SEQ = 8192


def one(model: str, world: int, batch: int, machine_name: str, rank: int) -> dict:
    """Simulate one rank (run in its own process, so that its resident peak is its own)."""
    from fourfold.config import Config, model_config
    from fourfold.plan import choose_grid
    from fourfold.plan.machine_file import load_machine
    from fourfold.simulate import FIT_PHASES, planner_tensor_bytes, simulate

    import dataclasses

    cfg = Config()
    cfg.model = model_config(model)
    cfg.train = dataclasses.replace(cfg.train, batch_size=batch, seq_len=SEQ, dtype="bfloat16",
                                    activation_checkpointing=True)
    machine = load_machine(machine_name)
    shape, _ = choose_grid(cfg.model, world, machine, batch, SEQ, dtype="bfloat16",
                           activation_checkpointing=True)
    start = time.perf_counter()
    rank = rank if rank >= 0 else shape.size - 1
    (report,) = simulate(cfg, shape, [rank], machine)
    assert report.planned_memory is not None
    return {"grid": str(shape), "rank": rank, "peak": report.peak,
            "end": [report.peaks[p] for p in FIT_PHASES],
            "planned": planner_tensor_bytes(report.planned_memory),
            "bytes": report.step_bytes, "planned_bytes": report.planned_bytes,
            "seconds": time.perf_counter() - start,
            "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--cases", default="70b:1024:128,405b:16384:1024",
                    help="MODEL:WORLD:BATCH,... (the global batch in sequences)")
    ap.add_argument("--machine", default="dgx-h100")
    ap.add_argument("--ranks", default="0,-1", help="ranks to simulate (-1: the last)")
    ap.add_argument("--one", help=argparse_hidden())
    args = ap.parse_args()
    if args.one:
        model, world, batch, rank = args.one.split(":")
        print(json.dumps(one(model, int(world), int(batch), args.machine, int(rank))))
        return
    header("Does the planner match the real code of a rank at scale?",
           "fake process group + FakeTensorMode; peak = live tensor bytes (planner: its total "
           "less the host runtime); bytes = one step's ledger per axis; val / sample / ckpt / "
           "export = the peaks of the rest of fit() (a validation, the final sample, a "
           "checkpoint's staging, the streamed export: no tensor written; on a GPU the "
           "snapshot and the full tensors are in host memory)")
    table = Table("model", "ranks", "grid", "rank", "peak GiB", "planner GiB", "diff",
                  "bytes x / y / z / data (GB)", "= planner", "val / sample / ckpt / export GiB",
                  "wall s", "resident GiB")
    for case in args.cases.split(","):
        model, world, batch = case.split(":")
        for rank in (int(r) for r in args.ranks.split(",")):
            out = subprocess.run([sys.executable, __file__, "--machine", args.machine,
                                  "--one", f"{model}:{world}:{batch}:{rank}"],
                                 capture_output=True, text=True)
            if out.returncode:
                table.row(model, world, "-", rank, "failed", "-", "-",
                          out.stderr.strip().splitlines()[-1][:80], "-", "-", "-", "-")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            gib = 2**30
            table.row(model, world, r["grid"], r["rank"], f"{r['peak'] / gib:.2f}",
                      f"{r['planned'] / gib:.2f}", f"{(r['peak'] / r['planned'] - 1) * 100:+.1f}%",
                      " / ".join(f"{r['bytes'][a] / 1e9:.2f}" for a in AXES),
                      "yes" if all(r["bytes"][a] == r["planned_bytes"][a] for a in AXES)
                      else "NO", " / ".join(f"{b / gib:.2f}" for b in r["end"]),
                      f"{r['seconds']:.0f}", f"{r['rss_kib'] / 2**20:.2f}")


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
