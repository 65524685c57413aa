"""The shared runner of bench/comm.py, bench/plan_check.py and bench/vs_torch_tp.py: train a
model for a few steps on every grid of N ranks (one torchrun job) and measure, per grid, the
bytes each axis moved per step (the engine's ledger, and with --count what torch.distributed
was handed), the step time, and the per-rank memory of parameters, gradients and optimizer
state.

    python bench/grids.py --nproc 8 [--layers 2 --dim 256 ...]   (prints JSON lines)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, fail, job_env

MODEL_ARGS = ("layers", "dim", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "steps",
              "dtype", "reduce_dtype")
FLAGS = ("overlap_forward", "activation_checkpointing", "probe", "count")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--grids", default="", help="only these grids, e.g. 1x1x2x4,2x1x2x2 (data x z x y x x)")
    ap.add_argument("--passes", type=int, default=1, help="round-robin passes over the grids "
                    "(--steps each, the first a warm-up); step_s is the median over all, so a "
                    "load that drifts during the run weighs on every grid alike")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="train.dtype: bfloat16 runs the forward under autocast")
    ap.add_argument("--reduce-dtype", dest="reduce_dtype", default="float32",
                    choices=("float32", "bfloat16"), help="parallel.reduce_dtype")
    ap.add_argument("--activation-checkpointing", dest="activation_checkpointing",
                    action="store_true", help="train.activation_checkpointing")
    ap.add_argument("--overlap-forward", dest="overlap_forward", action="store_true",
                    help="parallel.overlap_forward: each forward GEMM in two token halves")
    ap.add_argument("--probe", action="store_true", help="measure the host's costs "
                    "(fourfold.plan.host_probe.measure_host_costs) inside the job, once per pass")
    ap.add_argument("--count", action="store_true", help="also count what torch.distributed "
                    "is handed (tests/dist_count.py) and the z all-gathers per step")


def model_config(args: argparse.Namespace):
    from fourfold.config import ModelConfig
    return ModelConfig(preset="custom", n_layers=args.layers, dim=args.dim, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, ffn_dim=args.ffn, vocab_size=args.vocab,
                       max_seq_len=args.seq)


def all_grids(n: int) -> list[tuple[int, int, int, int]]:
    """Every (data, z, y, x) grid of n ranks, in lexicographic order."""
    from fourfold.plan import grid_shapes
    return sorted((s.data, s.z, s.y, s.x) for s in grid_shapes(n))


def run_grids(args: argparse.Namespace) -> list[dict]:
    """Launch the worker with torchrun; returns one dict per grid."""
    return run_grids_with_probes(args)[0]


def run_grids_with_probes(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Launch the worker with torchrun; returns one dict per grid and, with --probe, the
    job's merged host probe of each pass (else an empty list)."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"fourfold-grids-{os.getpid()}.jsonl"
    probe_path = Path(f"{out}.probe.json")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(args.nproc), __file__, "--worker", str(out)]
    for name in MODEL_ARGS:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.grids:
        argv += ["--grids", args.grids]
    argv += ["--passes", str(args.passes)]
    argv += [f"--{flag.replace('_', '-')}" for flag in FLAGS if getattr(args, flag, False)]
    proc = subprocess.run(argv, env=job_env(OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"the grids' job failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    out.unlink()
    probes = []
    if probe_path.is_file():
        probes = json.loads(probe_path.read_text())
        probe_path.unlink()
    return rows, probes


def worker(args: argparse.Namespace, out_path: str) -> None:
    counter = None
    if args.count:  # before fourfold binds any torch.distributed function
        sys.path.insert(0, str(ROOT / "tests"))
        from dist_count import DistCount

        counter = DistCount().install()
    import torch
    import torch.distributed as dist

    from fourfold.config import ParallelConfig
    from fourfold.models import build_model
    from fourfold.parallel import (Grid, GridError, GridShape, init_distributed, leave_job,
                                   parallelize)
    from fourfold.plan.host_probe import measure_host_costs, merge_rank_probes, probe_groups

    rank, world, device = init_distributed("gloo", 600)
    if not dist.is_initialized():  # one rank: init_distributed leaves it without a group, but
        # the barriers, the probe's all_gather_object and Grid.build below all want one
        store = dist.FileStore(f"{out_path}.store", 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.set_num_threads(1)
    cfg = model_config(args)
    wanted = [tuple(int(v) for v in g.split("x")) for g in args.grids.split(",") if g]
    grids = wanted or all_grids(world)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
            for _ in range(args.steps + 1)]
    rows = {g: {"grid": list(g)} for g in grids}
    times: dict[tuple, list[float]] = {g: [] for g in grids}
    built: dict[tuple, object] = {}  # one Grid (its process groups) per shape, for every pass
    probes = []
    groups = probe_groups(world) if args.probe else None
    for _ in range(args.passes):
        if groups is not None:
            parts = [None] * world
            dist.all_gather_object(parts, measure_host_costs(groups))
            probes.append(merge_rank_probes(parts))
        for d, z, y, x in grids:
            row = rows[(d, z, y, x)]
            if row.get("ok") is False:
                continue
            try:
                shape = GridShape(d, z, y, x)
                if shape not in built:
                    built[shape] = Grid.build(shape, device)
                grid = built[shape]
                model = build_model(cfg, seed=1)
                model.activation_checkpointing = args.activation_checkpointing
                pm = parallelize(model, grid, ParallelConfig(
                    x=x, y=y, z=z, data=d, overlap_forward=args.overlap_forward,
                    reduce_dtype=args.reduce_dtype))
                # fused, as the trainer builds it (fourfold.train.optim.build_optimizer)
                opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-3, fused=True)
                index, count = grid.batch_shard
                b = args.batch // count
                for step, tokens in enumerate(data):
                    local = tokens[index * b:(index + 1) * b]
                    pm.ledger.reset()
                    dist.barrier()
                    if counter is not None:
                        counter.reset()
                    start = time.perf_counter()
                    with torch.autocast("cpu", dtype=torch.bfloat16,
                                        enabled=args.dtype == "bfloat16"):
                        loss = pm(local[:, :-1], local[:, 1:]).sum() / (args.batch * args.seq)
                    loss.backward()
                    pm.finish_backward()
                    bytes_step = pm.ledger.snapshot()
                    if counter is not None:
                        handed = counter.by_axis(grid)
                        z_gathers = counter.calls(grid, "z", "all_gather")
                    pm.clip_grad_norm_(1.0)
                    opt.step()
                    mem = pm.memory_bytes(opt)  # before zero_grad frees the gradients
                    opt.zero_grad(set_to_none=True)
                    dist.barrier()
                    if step > 0:  # the first step warms up
                        times[(d, z, y, x)].append(time.perf_counter() - start)
                mem_max = torch.tensor([mem["params"], mem["grads"], mem["optimizer"]],
                                       dtype=torch.float64)
                dist.all_reduce(mem_max, op=dist.ReduceOp.MAX)
                t = sorted(times[(d, z, y, x)])
                if counter is not None:
                    row.update(handed=handed, z_gathers=z_gathers)
                row.update(ok=True, step_s=t[len(t) // 2], bytes=bytes_step,
                           micro_tokens=b * args.seq,
                           mem={"params": int(mem_max[0]), "grads": int(mem_max[1]),
                                "optimizer": int(mem_max[2])})
                del pm, opt, model
            except GridError as e:
                row.update(ok=False, error=str(e))
    rows = list(rows.values())
    if rank == 0 and probes:
        Path(f"{out_path}.probe.json").write_text(json.dumps(probes))
    if rank == 0:
        Path(out_path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.barrier()
    leave_job(0)  # destroy the process group, flush, os._exit


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a, a.worker)
    else:
        for r in run_grids(a):
            print(json.dumps(r))
