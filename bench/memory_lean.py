"""Peak resident memory and speed of each training method against AdamW, on one process.

Each method trains the same model (float32, activation checkpointing on) for a few steps in a
fresh process; its peak RSS above a process that only imports fourfold and builds nothing is
given as a ratio to AdamW's, and its tokens/s (steps after the first) beside AdamW's. A
training step of MeZO is two forwards, of ES `--population` forwards: tokens/s counts the
tokens of the batch once per step, so it compares steps, not forwards. BlockLLM runs at its
default sparsity (0.9) and patience (10, so the timed steps train the selection of the first
step, whose backward keeps only the gradients of the selection so far, freeing the others as
their norms are taken); GaLore at rank dim/4 with its SVD refresh in the first,
untimed step (one refresh per 200 steps by default: `first_step_s` shows its cost).

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

METHODS = ("adamw", "lomo", "adalomo", "mezo", "es", "blockllm", "galore")


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
    # on the meta device, as build_run does: parallelize makes the (one) shard of each tensor
    model = build_model(model_config(preset), seed=0, device="meta")
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
            "first_step_s": times[0], "peak_grad_bytes": trainer.peak_grad_bytes,
            "predicted": predicted_bytes(model.cfg, cfg, batch * seq),
            "loss": result.loss, "state_bytes": trainer.state_bytes()}


def predicted_bytes(model_cfg, train_cfg, tokens: int) -> int:
    """The planner's peak for this run (plan/memory.py with the method's state)."""
    from fourfold.parallel import GridShape
    from fourfold.plan.memory import Precision, predict_memory, predict_method_memory

    one, precision = GridShape(1, 1, 1, 1), Precision.of("float32")
    mem = predict_memory(model_cfg, one, tokens, True, precision, on_host=True)
    return predict_method_memory(mem, model_cfg, one, train_cfg, precision).total


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
    print("| method | peak RSS - base | ratio | planner | state | peak grads | tokens/s "
          "| vs adamw | first step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, r in rows.items():
        above = r["rss_kib"] - base
        print(f"| {m} | {above / 1024:.0f} MiB | {above / (ref['rss_kib'] - base):.2f} | "
              f"{r['predicted'] / 2**20:.0f} MiB | "
              f"{r['state_bytes'] / 2**20:.1f} MiB | {r['peak_grad_bytes'] / 2**20:.1f} MiB | "
              f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / ref['tokens_per_s']:.2f} | "
              f"{r['first_step_s']:.1f} s |")


if __name__ == "__main__":
    main()
