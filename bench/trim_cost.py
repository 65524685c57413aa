"""What handing the heap's free pages back (glibc's malloc_trim) costs each method's step.

Where a method trims on the host (on a CPU rank of a grid: LOMO, AdaLomo and BlockLLM at each
step's start, GaLore at its forward and update, MeZO and ES before each forward; GaLore before
each refresh everywhere: fourfold.train.host_memory's HostMemory.hooks), the pages it hands back are faulted in
again when the next tensors land on them. One run per method (one process, or with --grid
an x by y grid of gloo ranks under torchrun, with the malloc tuning `fourfold train` gives CPU
ranks): after --warmup steps its steps alternate, two with the trims and two without (the trim
made a no-op), so that both halves see the same load; rank 0's median step and minor page
faults per step of each half. A method that does not trim where it runs reads the same in
both halves.

    python bench/trim_cost.py [--grid XxY] [--preset 15m] [--steps 20] [--warmup 4]
        [--batch 8] [--seq 128] [--methods mezo es blockllm ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from lean_step_time import host_grid, launch, report  # noqa: E402  rank jobs
from memory_lean import METHODS, parse_grid  # noqa: E402


def child(preset: str, method: str, steps: int, warmup: int, batch: int, seq: int,
          grid: tuple[int, int]) -> dict:
    """Train `method` here (on a grid: this rank, under torchrun); this rank's two halves."""
    import resource
    import statistics
    import tempfile
    import time

    import torch
    import torch.distributed as dist

    import fourfold.train.host_memory as host_memory
    from fourfold.config import ParallelConfig, TrainConfig, model_config
    from fourfold.methods import method_spec
    from fourfold.models import build_model
    from fourfold.parallel import GridShape, parallelize
    from fourfold.train.methods import StepData, build_method

    host_memory.keep_freed_host_memory()
    x, y = grid
    shape = GridShape(y=y, x=x)
    tmp = tempfile.TemporaryDirectory()
    the_grid = host_grid(shape, tmp.name)
    model = build_model(model_config(preset), seed=0, device="meta")
    policy = host_memory.HostMemory.for_run(the_grid.device, the_grid.world_size, "float32")
    pmodel = parallelize(model, the_grid, ParallelConfig(x=x, y=y),
                         blocked_loss=method_spec(method).blocked_loss,
                         grad_buffers=policy.grad_buffers())
    cfg = TrainConfig(optimizer=method, lr=1e-4, seq_len=seq)
    trainer = build_method(pmodel, cfg, hooks=policy.hooks())  # as build_run gives them
    trim = host_memory._malloc_trim
    g = torch.Generator().manual_seed(0)
    halves: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    for i in range(warmup + steps):
        on = (i - warmup) // 2 % 2 == 0
        host_memory._malloc_trim = trim if on else (lambda: None)  # trim_host_memory's libc call
        tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g)
        dist.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        trainer.step(pmodel, StepData.one_batch(pmodel, tokens), cfg.lr)
        dist.barrier()
        took = time.perf_counter() - start
        if i >= warmup:
            halves[on].append((took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    host_memory._malloc_trim = trim
    row = {f"{'with' if on else 'without'}_{what}": statistics.median(v[k] for v in runs)
           for on, runs in halves.items() for k, what in ((0, "s"), (1, "faults"))}
    if shape.size == 1:
        dist.destroy_process_group()
    tmp.cleanup()
    return row


def measure(args: argparse.Namespace, method: str) -> dict:
    """One fresh process, or one torchrun launch of x * y gloo ranks: rank 0's row."""
    from fourfold.host import rank_malloc_environment

    x, y = args.grid
    spec = json.dumps([args.preset, method, args.steps, args.warmup, args.batch, args.seq,
                       [x, y]])
    return launch(__file__, spec, x * y, method, rank_malloc_environment())


def rank_worker(spec: str) -> None:
    preset, method, steps, warmup, batch, seq, grid = json.loads(spec)
    report(child(preset, method, steps, warmup, batch, seq, tuple(grid)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="15m")
    ap.add_argument("--steps", type=int, default=20, help="timed steps, half of them trimmed")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["mezo", "es", "blockllm"], choices=METHODS)
    ap.add_argument("--grid", default="1x1", metavar="XxY",
                    help="x by y gloo ranks under torchrun (data = z = 1)")
    ap.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        rank_worker(args.rank_worker)
        return
    args.grid = parse_grid(args.grid)
    if args.steps < 4 or args.warmup < 0:
        sys.exit(f"error: --steps {args.steps} --warmup {args.warmup}: at least 4 timed steps "
                 "(two of each half), and no negative warmup")
    x, y = args.grid
    where = "one process" if x * y == 1 else f"grid x = {x}, y = {y} (rank 0)"
    print(f"preset {args.preset}, float32, batch {args.batch} x {args.seq}, {where}; "
          f"{args.steps} steps after {args.warmup}, alternating two with the trims and two "
          "without; medians")
    print("| method | step with trims | without | ratio | page faults a step with | without |")
    print("|---|---|---|---|---|---|")
    for m in args.methods:
        r = measure(args, m)
        print(f"| {m} | {r['with_s'] * 1e3:.1f} ms | {r['without_s'] * 1e3:.1f} ms | "
              f"{r['with_s'] / r['without_s']:.3f} | {r['with_faults']:.0f} | "
              f"{r['without_faults']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
