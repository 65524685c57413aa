"""GEMM tuning on this machine: for the GEMMs of a linear layer (forward, input gradient,
weight gradient) at the shapes of a ~35M-parameter model, time each equivalent way (the
matmul layouts, and oneDNN's matmul on CPU) and show what choosing the fastest gains over the
plain one.

    python bench/gemm.py [--tokens 4096] [--dtype float32|bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from fourfold.parallel.gemm import VARIANTS
from fourfold.train.host_memory import keep_freed_host_memory


def timeit(fn, a, b, repeats: int) -> float:
    fn(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    n = args.tokens
    # as the trainer does: without it each large output lands on fresh, zero-filled pages
    # (the 32000x512 oneDNN forward at 1024 tokens: 216 ms without, 157-164 ms with)
    keep_freed_host_memory()
    # (out, in) of the distinct linear shapes: attention, MLP up/down (width 512), output layer
    shapes = [(512, 512), (1536, 512), (512, 1536), (32000, 512)]
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} tokens={n}")
    print(f"{'kind':<12} {'out x in':>11} {'plain ms':>9} {'best ms':>8} {'best layout':<16} {'gain':>6}")
    total_plain = total_best = 0.0
    for out_f, in_f in shapes:
        x = torch.randn(n, in_f, dtype=dtype)
        w = torch.randn(out_f, in_f, dtype=dtype)
        dy = torch.randn(n, out_f, dtype=dtype)
        operands = {"forward": (x, w), "input_grad": (dy, w), "weight_grad": (dy, x)}
        for kind, (a, b) in operands.items():
            times = [timeit(fn, a, b, args.repeats) for _, fn in VARIANTS[kind]]
            best = min(range(len(times)), key=times.__getitem__)
            total_plain += times[0]
            total_best += times[best]
            print(f"{kind:<12} {out_f:>5}x{in_f:<5} {times[0] * 1e3:>9.2f} {times[best] * 1e3:>8.2f} "
                  f"{VARIANTS[kind][best][0]:<16} {times[0] / times[best]:>5.2f}x")
    print(f"{'all':<12} {'':>11} {total_plain * 1e3:>9.2f} {total_best * 1e3:>8.2f} {'':<16} "
          f"{total_plain / total_best:>5.2f}x")


if __name__ == "__main__":
    main()
