"""Peak resident memory and speed of each training method against AdamW, on one process.

Each method trains the same model (float32, activation checkpointing on) for a few steps in a
fresh process; its peak RSS above a process that only imports fourfold and builds nothing is
given as a ratio to AdamW's, and its tokens/s (steps after the first) beside AdamW's. A
training step of MeZO is two forwards, of ES `--population` forwards: tokens/s counts the
tokens of the batch once per step, so it compares steps, not forwards.

    python bench/memory_lean.py [--preset small] [--steps 4] [--batch 2] [--seq 128]

The issue's table uses --preset 125m (about 2 GiB with AdamW); keep to small presets on a
shared machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

METHODS = ("adamw", "lomo", "adalomo", "mezo", "es")


def child(preset: str, method: str, steps: int, batch: int, seq: int, population: int) -> dict:
    import torch

    import fourfold  # noqa: F401  (the baseline process imports this much)
    if method == "none":
        return {"rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    from fourfold.config import TrainConfig, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.methods import StepData, build_method

    torch.set_num_threads(1)
    model = build_model(model_config(preset), seed=0)
    model.activation_checkpointing = True
    pmodel = parallelize(model, Grid.single())
    extra = {"es_population": population} if method == "es" else {}
    cfg = TrainConfig(optimizer=method, lr=1e-4, seq_len=seq, **extra)
    trainer = build_method(pmodel, cfg)
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)

        def losses():
            yield pmodel(tokens[:, :-1], tokens[:, 1:]).mean()

        start = time.perf_counter()
        result = trainer.step(pmodel, StepData(1, losses), cfg.lr)
        times.append(time.perf_counter() - start)
    return {"rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "tokens_per_s": batch * seq * (len(times) - 1) / sum(times[1:]),
            "loss": result.loss, "state_bytes": trainer.state_bytes()}


def measure(args: argparse.Namespace, method: str) -> dict:
    code = ("import json, sys; sys.path.insert(0, 'bench'); import memory_lean as m; "
            f"print(json.dumps(m.child({args.preset!r}, {method!r}, {args.steps}, {args.batch}, "
            f"{args.seq}, {args.population})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {method} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--population", type=int, default=4, help="ES members per step")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = ap.parse_args()
    if args.steps < 2:
        sys.exit("error: --steps must be at least 2 (the first step is not timed)")
    base = measure(args, "none")["rss_kib"]
    rows = {m: measure(args, m) for m in dict.fromkeys(["adamw", *args.methods])}
    ref = rows["adamw"]
    print(f"preset {args.preset}, float32, batch {args.batch} x {args.seq}, activation "
          f"checkpointing, one process; baseline (import fourfold) {base / 1024:.0f} MiB")
    print(f"{'method':<8} {'peak RSS - base':>16} {'ratio':>6} {'state':>10} {'tokens/s':>9} "
          f"{'vs adamw':>8}")
    for m, r in rows.items():
        above = r["rss_kib"] - base
        print(f"{m:<8} {above / 1024:>12.0f} MiB {above / (ref['rss_kib'] - base):>6.2f} "
              f"{r['state_bytes'] / 2**20:>6.1f} MiB {r['tokens_per_s']:>9.0f} "
              f"{r['tokens_per_s'] / ref['tokens_per_s']:>8.2f}")


if __name__ == "__main__":
    main()
