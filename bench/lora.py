"""Adapters: LoRA and norm tuning against full fine-tuning on one process: trainable parameters, peak
resident memory, tokens/s and the loss after the same steps from the same starting weights.
Each mode runs in a fresh interpreter, so that its peak resident memory is its own.

    python bench/lora.py [--preset 125m] [--steps 300] [--batch 2] [--seq 128]

Peak RSS under glibc's default (dynamic) mmap threshold includes freed heap that malloc keeps:
a LoRA step's transient tensors leave ~350 MiB there at 125m, where full fine-tuning reuses its
freed gradients. MALLOC_MMAP_THRESHOLD_=131072 fixes the threshold for every mode alike.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, fail, header, parser  # noqa: E402

MODES = ("full", "lora", "norm")


def one(mode: str, preset: str, steps: int, batch: int, seq: int, device: str) -> dict:
    import torch

    from fourfold.config import AdapterConfig, TrainConfig, model_config
    from fourfold.data import BatchLoader, resolve_data_path
    from fourfold.models import build_model
    from fourfold.models.adapter import apply_adapter
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.metrics import peak_memory_bytes  # this process's own peak
    from fourfold.train.optim import build_optimizer

    cfg = model_config(preset, vocab_size=max(257, model_config(preset).vocab_size))
    model = build_model(cfg, seed=0).to(device)  # the "checkpoint" every mode starts from
    pmodel = parallelize(model, Grid.single(device))
    if mode != "full":
        apply_adapter(pmodel, AdapterConfig(kind=mode), seed=0)
    lr = 3e-4 if mode == "full" else 3e-3
    opt = build_optimizer(pmodel.named_parameters(), TrainConfig(lr=lr, weight_decay=0.0))
    loader = BatchLoader(resolve_data_path("builtin:stdlib", "byte"), "train", batch, seq, 0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    losses, times = [], []
    for step in range(steps):
        started = time.perf_counter()
        x, y = (t.to(device) for t in loader.next_batch())
        loss = pmodel(x, y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if step >= 2:  # after the first steps' allocations and warm-up
            times.append(time.perf_counter() - started)
    # the median step: a shared machine's load spikes do not move it much
    median = sorted(times)[len(times) // 2]
    tail = losses[-max(1, steps // 10):]
    return {"mode": mode, "trainable": trainable, "total": total,
            "peak_rss_mib": peak_memory_bytes(torch.device("cpu")) / 2**20,
            "tokens_per_s": batch * seq / median, "final_loss": sum(tail) / len(tail)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.preset, a.steps, a.batch, a.seq, a.device)))
        return
    if a.steps < 2:
        fail(f"--steps {a.steps}: must be at least 2 (the first step is not timed)")
    header("LoRA and norm tuning against full fine-tuning",
           f"preset {a.preset}, {a.device}, float32, batch {a.batch} x {a.seq}, {a.steps} steps; "
           "tokens/s: the median step; loss: the mean of the last tenth of the steps")
    table = Table("mode", "trainable", "share", "peak RSS MiB", "vs full", "tokens/s",
                  "vs full", "loss")
    full: dict = {}
    for mode in MODES:
        proc = subprocess.run([sys.executable, __file__, "--one", mode, "--preset", a.preset,
                               "--steps", str(a.steps), "--batch", str(a.batch),
                               "--seq", str(a.seq), "--device", a.device],
                              capture_output=True, text=True)
        if proc.returncode:
            fail(f"{mode} failed:\n{proc.stderr[-2000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        full = full or r
        table.row(mode, f"{r['trainable']:,}", f"{r['trainable'] / r['total']:.2%}",
                  f"{r['peak_rss_mib']:,.0f}", f"{r['peak_rss_mib'] / full['peak_rss_mib']:.2f}",
                  f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}",
                  f"{r['final_loss']:.4f}")


if __name__ == "__main__":
    main()
