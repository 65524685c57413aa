"""The planner's memory against the tensors a step really holds at once: glibc's heap in use,
read after every aten op (tests/rank_memory_worker.py's HeapPeak), from before the build to
the end of the last step, beside plan/memory.py's prediction without host runtime (what a GPU's
torch.cuda.max_memory_allocated is compared with). One process, or every rank of an x by y
grid of gloo ranks. The forward runs under bfloat16 autocast with --dtype bfloat16, as the
trainer runs it; activation checkpointing is on.

    python bench/heap_peak.py [--preset small] [--vocab N] [--batch 4] [--seq 512]
        [--methods adamw lomo ...] [--dtype float32|bfloat16] [--steps 2] [--grid XxY]

Measured (stop 37): --vocab 32000 --batch 1 --methods adamw: float32 361 MiB, planner -1.8%;
bfloat16 414 MiB, -2.1%. --preset 125m --batch 2 --seq 128 --methods adamw galore: 2064 and
1049 MiB in use at their peaks (GaLore 0.51 of AdamW), planner +1.7% and +4.0%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import rank_memory_worker  # noqa: E402
from fourfold.config import CHOICES  # noqa: E402
from memory_lean import METHODS, parse_grid, predicted_bytes, train_config  # noqa: E402

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--vocab", type=int, default=None, help="the preset's vocabulary size")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--methods", nargs="+", default=["adamw", "lomo"], choices=METHODS)
    ap.add_argument("--dtype", default="float32", choices=CHOICES[("train", "dtype")])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--grid", default=None, metavar="XxY")
    args = ap.parse_args()
    if args.steps < 1 or args.batch < 1 or args.seq < 1:
        sys.exit("error: --steps, --batch and --seq must be at least 1")

    from fourfold.config import model_config
    from fourfold.errors import FourfoldError
    from fourfold.parallel import Grid, GridShape

    try:
        mcfg = model_config(args.preset)
    except FourfoldError as e:
        sys.exit(f"error: {e}")
    if args.vocab is not None:
        mcfg = dataclasses.replace(mcfg, vocab_size=args.vocab)
    x, y = parse_grid(args.grid) if args.grid else (1, 1)
    shape = GridShape(data=1, z=1, y=y, x=x)
    train = [dataclasses.replace(train_config(m, args.seq, 4), dtype=args.dtype)
             for m in args.methods]
    if shape.size == 1:
        peaks = [[rank_memory_worker.run_method_steps(mcfg, Grid.single(), t, args.batch,
                                                      steps=args.steps)] for t in train]
    else:
        spec = {"shape": [1, 1, y, x], "steps": args.steps, "cases": [
            {"model": dataclasses.asdict(mcfg), "train": dataclasses.asdict(t),
             "batch": args.batch} for t in train]}
        with tempfile.TemporaryDirectory() as tmp:
            rows, stderr = rank_memory_worker.launch(
                shape.size, "steps", Path(tmp) / "heap.jsonl",
                {"FOURFOLD_RANK_MEM_MODEL": json.dumps(spec)}, timeout_s=1800)
        if rows is None:
            sys.exit(f"error: the {x}x{y} launch failed:\n{stderr[-3000:]}")
        peaks = [[r["heap_peaks"][i] for r in rows] for i in range(len(train))]
    print(f"preset {args.preset}, vocabulary {mcfg.vocab_size}, {args.dtype}, batch "
          f"{args.batch} x {args.seq}, {args.steps} steps, activation checkpointing, "
          f"grid x = {x}, y = {y}: the heap in use at its peak per rank, against the planner")
    print("| method | heap peak (ranks) | planner | error (worst) |")
    print("|---|---|---|---|")
    for t, measured in zip(train, peaks):
        predicted = predicted_bytes(mcfg, t, args.batch * args.seq, shape, on_host=False)
        worst = max((predicted / m - 1 for m in measured), key=abs)
        print(f"| {t.optimizer} | {min(measured) / MIB:.0f}-{max(measured) / MIB:.0f} MiB | "
              f"{predicted / MIB:.0f} MiB | {worst:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
