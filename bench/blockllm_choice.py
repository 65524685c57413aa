"""BlockLLM's choice on the host in a selection step, measured against the planner's model.

A selection step runs AdamW's backward (every candidate trainable) and, at each gradient's
hand-off, the choice's own work: the gradient's row norms, and whenever the held rows outgrow
the budget by BLOCKLLM_HOLD_SLACK of the elements, a ranking of them (choose_rows) and a gather
of the kept rows; once the first ranking has set a floor, each later tensor's rows below it
are dropped at once. Each preset trains one process (float32, activation checkpointing, glibc
tuned as `fourfold train` tunes CPU runs) for --steps steps, alternating selection and
training steps, and reports the medians: the selection and training steps, the hand-offs'
time in a selection, the rankings (calls, seconds), the rows gathered (MiB, seconds) and the
peak of gradients held; beside them `plan.perf.blockllm_choice_work` / `_seconds` (rankings,
MiB gathered, seconds at this host's copy rate).

    python bench/blockllm_choice.py [--presets 15m 125m] [--steps 5] [--batch 2] [--seq 128]
        [--sparsity 0.9]

Measured on the 2-core AMD EPYC host (stop 32), the code before (3867dfa: a ranking at every
hand-off, rows gathered with g[index]) and after, one run each:

    preset  train    selection  hand-offs  rankings        gathered           peak grads
    15m     0.268 s  0.530 s    0.208 s     58  0.081 s     62 MiB  0.064 s   13 MiB   (before)
    15m     0.238 s  0.336 s    0.066 s      7  0.012 s     24 MiB  0.022 s   14 MiB
    125m    2.960 s  4.862 s    1.394 s    112  0.402 s   1638 MiB  0.602 s  145 MiB   (before)
    125m    2.646 s  3.292 s    0.415 s      8  0.057 s    317 MiB  0.137 s  148 MiB

(the same choices: tests/test_lean_optim.py holds them to a full backward's); the planner:
15m 7 rankings, 28 MiB, 0.023 s; 125m 7, 364 MiB, 0.189 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def child(preset: str, steps: int, batch: int, seq: int, sparsity: float) -> dict:
    import torch

    from fourfold.config import ParallelConfig, load_config, model_config
    from fourfold.models import build_model
    from fourfold.parallel import Grid, parallelize
    from fourfold.plan.host_probe import time_copy
    from fourfold.plan.perf import blockllm_choice_seconds, blockllm_choice_work
    from fourfold.train.host_memory import keep_freed_host_memory
    from fourfold.train.methods import StepData, blockllm, build_method

    keep_freed_host_memory()
    acc = {"hand_s": 0.0, "rank_s": 0.0, "rankings": 0, "gather_s": 0.0, "gathered": 0}

    def timed(owner, name, key, after=None):
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            acc[key] += time.perf_counter() - start
            if after is not None:
                after(args, out)
            return out

        setattr(owner, name, wrapped)

    def count_ranking(args, out):
        acc["rankings"] += 1

    def count_gather(args, out):
        if out is not args[-1]:  # a gather, not the gradient itself
            acc["gathered"] += out.numel() * out.element_size()

    timed(blockllm.BlockLLM, "_on_grad_ready", "hand_s")
    timed(blockllm, "choose_rows", "rank_s", count_ranking)
    timed(blockllm.BlockLLM, "_subset", "gather_s", count_gather)

    model = build_model(model_config(preset), seed=0, device="meta")
    model.activation_checkpointing = True
    pmodel = parallelize(model, Grid.single(), ParallelConfig(), optimizer="blockllm")
    cfg = load_config(overrides=["train.optimizer=blockllm", "train.lr=1e-4",
                                 f"train.seq_len={seq}",
                                 f"train.block_sparsity={sparsity}"]).train
    method = build_method(pmodel, cfg)
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[dict]] = {"select": [], "train": []}
    for i in range(steps):
        tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g)
        method.selecting_next = i % 2 == 0
        kind = "select" if method.selecting_next else "train"
        for key in acc:
            acc[key] = 0
        start = time.perf_counter()
        method.step(pmodel, StepData.one_batch(pmodel, tokens), 1e-4)
        if i > 0:  # the first step pages the heap in
            rows[kind].append(dict(acc, step_s=time.perf_counter() - start))
    copy = time_copy(0.3)
    work = blockllm_choice_work(model.cfg, sparsity)
    med = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for kind, rs in rows.items() if rs}
    return {"measured": med, "peak_grad_bytes": method.peak_grad_bytes,
            "planner": {"rankings": work.rankings, "gathered": work.gathered * 4,
                        "seconds": blockllm_choice_seconds(model.cfg, sparsity, copy),
                        "ranking_s": blockllm_choice_seconds(model.cfg, sparsity,
                                                             float("inf"))},
            "copy_bytes_per_s": copy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["15m", "125m"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--sparsity", type=float, default=0.9)
    args = ap.parse_args()
    if args.steps < 4:
        sys.exit(f"error: --steps {args.steps}: give at least 4 (the first is not timed)")
    if not 0.0 < args.sparsity < 1.0:
        sys.exit(f"error: --sparsity {args.sparsity}: give a share between 0 and 1")
    print(f"one process, batch {args.batch} x {args.seq}, sparsity {args.sparsity}; "
          "medians of the steps after the first (measured | planner)")
    print("| preset | train step | selection step | hand-offs | rankings | ranking | "
          "gathered | gathering | peak grads | planner: rankings | gathered | choice |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        code = ("import json, sys; sys.path.insert(0, 'bench'); import blockllm_choice as b; "
                f"print(json.dumps(b.child({preset!r}, {args.steps}, {args.batch}, "
                f"{args.seq}, {args.sparsity})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"error: {preset} failed:\n{proc.stderr[-2000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        s, t, p = r["measured"]["select"], r["measured"]["train"], r["planner"]
        mib = 2**20
        print(f"| {preset} | {t['step_s']:.3f} s | {s['step_s']:.3f} s | {s['hand_s']:.3f} s | "
              f"{s['rankings']:.0f} | {s['rank_s']:.3f} s | {s['gathered'] / mib:.0f} MiB | "
              f"{s['gather_s']:.3f} s | {r['peak_grad_bytes'] / mib:.0f} MiB | "
              f"{p['rankings']} | {p['gathered'] / mib:.0f} MiB | {p['seconds']:.3f} s "
              f"({p['ranking_s']:.3f} ranking) |")


if __name__ == "__main__":
    main()
