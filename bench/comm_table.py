"""Bytes per step per axis and step time of the engine's communication, for the grids of
issue 14 (x2·z2, y2·z2, x2·y2·z2, data2·z2), float32 and bfloat16 autocast, activation
checkpointing off and on. Each row also gives the bytes torch.distributed was handed (counted
by wrapping it, not by the ledger), the z all-gathers per step and the collectives issued by
one transformer block's forward.

    python bench/comm_table.py [--save before.json] [--compare before.json] [--set KEY=VALUE]

--set passes a [parallel] key (e.g. --set reduce_dtype=bfloat16) to every run; with --compare
each cell also shows the ratio to a saved table (run the script on the base commit with
PYTHONPATH pointing at its src/ and --save to make one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GRIDS = {4: [(1, 2, 1, 2), (1, 2, 2, 1), (2, 2, 1, 1)], 8: [(1, 2, 2, 2)]}  # data z y x
NAMES = {(1, 2, 1, 2): "x2.z2", (1, 2, 2, 1): "y2.z2", (1, 2, 2, 2): "x2.y2.z2",
         (2, 2, 1, 1): "data2.z2"}
AXES = ("x", "y", "z", "data")


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = {"true": True, "false": False}.get(value, value)
    return out


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dist_count import DistCount
    counter = DistCount().install()  # before fourfold binds any torch.distributed function

    import torch
    import torch.distributed as dist

    from fourfold.config import ModelConfig, ParallelConfig
    from fourfold.models import build_model
    from fourfold.parallel import Grid, GridShape, init_distributed, leave_job, parallelize

    rank, world, device = init_distributed("gloo", 600)
    torch.set_num_threads(1)
    cfg = ModelConfig(preset="custom", n_layers=args.layers, dim=args.dim, n_heads=args.heads,
                      n_kv_heads=args.heads, ffn_dim=args.ffn, vocab_size=args.vocab,
                      max_seq_len=args.seq)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
            for _ in range(args.steps + 1)]
    extra = parse_sets(args.set)
    rows = []
    for shape_t in [g for g in GRIDS[world] if not args.only or NAMES[g] in args.only]:
        d, z, y, x = shape_t
        shape = GridShape(d, z, y, x)
        grid = Grid.build(shape, device)
        for dtype in ("float32", "bfloat16"):
            for ckpt in (False, True):
                model = build_model(cfg, seed=1)
                model.activation_checkpointing = ckpt
                pm = parallelize(model, grid, ParallelConfig(x=x, y=y, z=z, data=d, **extra))
                opt = torch.optim.SGD(list(pm.parameters()), lr=1e-2)
                block = model.layers[0]
                state = {"phase": "", "in_block": False, "block_calls": 0}

                def pre(_m, _a):
                    if state["phase"] == "forward":
                        state["in_block"], state["start"] = True, len(counter.records)

                def post(_m, _a, _o):
                    if state["in_block"]:
                        recs = counter.records[state["start"]:]
                        state["block_calls"] = len(recs)
                        state["block_ops"] = {op: sum(1 for r in recs if r[0] == op)
                                              for op in ("all_gather", "all_reduce")}
                        state["in_block"] = False

                block.register_forward_pre_hook(pre)
                block.register_forward_hook(post)
                index, count = grid.batch_shard
                b = args.batch // count
                times = []
                for step, tokens in enumerate(data):
                    local = tokens[index * b:(index + 1) * b]
                    pm.ledger.reset()
                    counter.reset()
                    dist.barrier()
                    counter.reset()
                    start = time.perf_counter()
                    state["phase"] = "forward"
                    with torch.autocast("cpu", dtype=torch.bfloat16,
                                        enabled=dtype == "bfloat16"):
                        loss = pm(local[:, :-1], local[:, 1:]).sum() / (args.batch * args.seq)
                    state["phase"] = "backward"
                    loss.backward()
                    pm.finish_backward()
                    ledger = pm.ledger.snapshot()
                    handed = counter.by_axis(grid)
                    z_gathers = counter.calls(grid, "z", "all_gather")
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    dist.barrier()
                    if step > 0:
                        times.append(time.perf_counter() - start)
                rows.append({"grid": NAMES[shape_t], "dtype": dtype, "ckpt": ckpt,
                             "ledger": ledger, "handed": handed,
                             "emulated": int(getattr(pm.ledger, "emulated", 0)),
                             "z_gathers": z_gathers, "block_fwd_calls": state["block_calls"],
                             "block_fwd_ops": state.get("block_ops", {}),
                             "step_s": sorted(times)[len(times) // 2]})
    if rank == 0:
        Path(args.worker).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.barrier()
    leave_job(0)


def run(args: argparse.Namespace, nproc: int) -> list[dict]:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"fourfold-commtable-{os.getpid()}-{nproc}.jsonl"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), __file__, "--worker", str(out)]
    for name in ("layers", "dim", "heads", "ffn", "vocab", "seq", "batch", "steps"):
        argv += [f"--{name}", str(getattr(args, name))]
    for item in args.set:
        argv += ["--set", item]
    for name in args.only:
        argv += ["--only", name]
    proc = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"worker failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    out.unlink()
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], help="a [parallel] key=value")
    ap.add_argument("--only", action="append", default=[], help="only this grid (x2.z2, ...)")
    ap.add_argument("--save", default=None)
    ap.add_argument("--compare", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    rows = [r for n in (4, 8) if not args.only or any(NAMES[g] in args.only for g in GRIDS[n])
            for r in run(args, n)]
    if args.save:
        Path(args.save).write_text(json.dumps(rows, indent=1))
    before = {}
    if args.compare:
        saved = json.loads(Path(args.compare).read_text())
        before = {(r["grid"], r["dtype"], r["ckpt"]): r for r in saved}
    print(f"model: {args.layers} layers, dim {args.dim}, ffn {args.ffn}, vocab {args.vocab}; "
          f"batch {args.batch} x seq {args.seq}; {' '.join(args.set) or 'defaults'}")
    print("MiB per step per rank (ledger; ratio to what torch.distributed was handed before); "
          "handed: what torch.distributed was handed (! where it differs from the ledger); "
          "zAG: z all-gathers per step (now/before); "
          "blkfwd: collectives of one block's forward, gathers+all-reduces (2 of them norm "
          "statistics) = total (now/before); step s now/before")
    print(f"{'grid':<9} {'dtype':<8} {'ckpt':<4} " + " ".join(f"{a:>14}" for a in AXES)
          + f" {'total':>14} {'handed':>7} {'zAG':>7} {'blkfwd':>6} {'step s':>12}")
    for r in rows:
        b = before.get((r["grid"], r["dtype"], r["ckpt"]))
        cells = []
        for a in AXES + ("total",):
            v = sum(r["ledger"][k] for k in AXES) if a == "total" else r["ledger"][a]
            # against what torch.distributed was handed before (an older ledger counted
            # bfloat16 buffers at their size while gloo was handed them as float32)
            if b is not None and a != "total":
                old = b["handed"][a]
            elif b is not None:
                old = sum(b["handed"][k] for k in AXES)
            else:
                old = None
            ratio = f" {v / old:.2f}x" if old else ""
            cells.append(f"{mib(v) + ratio:>14}")
        handed = sum(r["handed"][a] for a in AXES)
        honest = f"{mib(handed)}" + ("" if all(r["handed"][a] == r["ledger"][a] for a in AXES)
                                     else "!")
        zag = f"{r['z_gathers']}" + (f"/{b['z_gathers']}" if b else "")
        ops = r.get("block_fwd_ops", {})
        blk = (f"{ops.get('all_gather', 0)}+{ops.get('all_reduce', 0)}="
               f"{r['block_fwd_calls']}" + (f"/{b['block_fwd_calls']}" if b else ""))
        step = f"{r['step_s']:.3f}" + (f"/{b['step_s']:.3f}" if b else "")
        print(f"{r['grid']:<9} {r['dtype']:<8} {'on' if r['ckpt'] else 'off':<4} "
              + " ".join(cells) + f" {honest:>7} {zag:>7} {blk:>10} {step:>12}")


if __name__ == "__main__":
    main()
