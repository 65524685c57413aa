"""Where one training step's time goes: the torch profiler over a step of one of
bench/throughput.py's implementations and shapes, self CPU time grouped into GEMMs, attention
and everything else, then the top operators.

    python bench/profile_step.py [--shape 35m] [--dtype float32] [--impl fourfold] [--warmup 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from throughput import DTYPES, IMPLEMENTATIONS, SHAPES, build_step  # noqa: E402

GROUPS = {  # operator-name fragments -> group, first match wins
    "GEMM": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
    "attention": ("scaled_dot_product",),
}


def group_of(name: str) -> str:
    for group, fragments in GROUPS.items():
        if any(f in name for f in fragments):
            return group
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="35m", choices=list(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--impl", default="fourfold", choices=IMPLEMENTATIONS)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--top", type=int, default=12, help="operators listed")
    a = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from fourfold.train.host_memory import keep_freed_host_memory

    keep_freed_host_memory()  # as the trainer does (and as --same-malloc gives the loops)
    c, seq, batch = SHAPES[a.shape]
    with tempfile.TemporaryDirectory() as tmp:
        step, _ = build_step(a.impl, c, seq, batch, a.dtype, tmp)
        for _ in range(a.warmup):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    ops = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    total = sum(ms for _, ms, _ in ops)
    print(f"{a.impl}, {a.shape} {a.dtype}: one step, {total:.0f} ms of self CPU time")
    shares: dict[str, float] = {}
    for name, ms, _ in ops:
        shares[group_of(name)] = shares.get(group_of(name), 0.0) + ms
    for group in (*GROUPS, "other"):
        ms = shares.get(group, 0.0)
        print(f"  {group:<10} {ms:8.0f} ms {100 * ms / total:5.1f}%")
    print()
    print(f"  {'operator':<58} {'ms':>8} {'calls':>6}")
    for name, ms, count in sorted(ops, key=lambda o: -o[1])[:a.top]:
        print(f"  {name[:58]:<58} {ms:8.1f} {count:6d}")


if __name__ == "__main__":
    main()
