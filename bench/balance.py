"""Balancing packed rows over data-parallel ranks: how unequal the ranks' work is, and the step
time, when each global batch's rows are dealt out in order and when the loader spreads them by
cost (data/balance.py), on N gloo ranks (data parallel).

The data: texts of heavy-tailed (Pareto) lengths, most short, a few filling a row alone,
packed into rows of --seq positions (data.packing = "documents"); a narrow model, whose
attention outweighs its GEMMs on a whole row, so that documents' lengths decide a row's work.
Each step the two ways take turns on the same global batches.

    python bench/balance.py [--nproc 4] [--seq 2048] [--batch 32] [--micro 2] [--steps 6]

Columns: predicted: the dearest rank's cost over the mean by the planner's cost model
(plan/perf.py sequence_cost); measured: the same for each rank's CPU time in forward and
backward (its own thread's time, which waiting does not count); step s: the median wall time
of a step, from a barrier to the update. On a host with fewer cores than ranks the ranks share
the cores, so a rank that finishes early gives its core to the others: there the step time
moves less than the work does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, fail, header, job_env, parser  # noqa: E402

WAYS = {"in order": False, "balanced": True}


def model_config(seq: int):  # noqa: ANN201
    from fourfold.config import model_config as preset

    return preset("debug", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=257,
                  max_seq_len=seq)


def write_texts(path: Path, n: int, seq: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = min(int(rng.paretovariate(1.0) * 40), seq)
            f.write(json.dumps({"text": "".join(rng.choice("abcdefgh ")
                                                for _ in range(length))}) + "\n")


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from fourfold.config import ParallelConfig
    from fourfold.data import BatchLoader
    from fourfold.data.balance import imbalance
    from fourfold.models import build_model
    from fourfold.parallel import Grid, GridShape, init_distributed, leave_job, parallelize
    from fourfold.plan.perf import sequence_cost

    rank, world, device = init_distributed("gloo", 600)
    torch.set_num_threads(1)
    grid = Grid.build(GridShape(data=world, z=1, y=1, x=1), device)
    cfg = model_config(a.seq)
    cost = sequence_cost(cfg, a.seq)
    loaders = {way: BatchLoader(a.data, "train", a.batch, a.seq, seed=0, shard_index=rank,
                                num_shards=world, micro_batches=a.micro, cost=cost,
                                packing="documents", balance=balance)
               for way, balance in WAYS.items()}
    pmodel = parallelize(build_model(cfg, seed=1), grid, ParallelConfig(data=world))
    optimizer = torch.optim.SGD(list(pmodel.parameters()), lr=1e-3)
    found: dict[str, dict[str, list[float]]] = {
        way: {"predicted": [], "measured": [], "step": []} for way in WAYS}
    for step in range(a.steps):
        for way, loader in loaders.items():
            batch = loader.next_batch()
            mine = sum(cost.row(torch.unique_consecutive(row, return_counts=True)[1].tolist())
                       for row in batch.documents)
            micro = batch.split(a.micro)
            weights = [m.loss_weights() for m in micro]
            count = pmodel.reduce_over_batch(torch.stack([w.sum() for w in weights]).sum())
            dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            for i, (m, w) in enumerate(zip(micro, weights)):
                pmodel.set_requires_gradient_sync(i == len(micro) - 1)
                loss = (pmodel(m.inputs, m.targets, documents=m.documents) * w).sum() / count
                loss.backward()
                pmodel.finish_backward()
            cpu = time.thread_time() - cpu
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            wall = time.perf_counter() - wall
            shares = torch.tensor([mine, cpu, wall], dtype=torch.float64)
            gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(gathered, shares)
            table = torch.stack(gathered)
            if step >= 1:  # the first steps warm up
                order = list(range(world))
                found[way]["predicted"].append(imbalance(table[:, 0].numpy(), order, world))
                found[way]["measured"].append(imbalance(table[:, 1].numpy(), order, world))
                found[way]["step"].append(float(table[:, 2].max()))
    if rank == 0:
        Path(a.out).write_text(json.dumps(found))
    dist.barrier()
    leave_job(0)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--texts", type=int, default=3000)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    if a.steps < 2:
        fail(f"--steps {a.steps}: must be at least 2 (the first is not counted)")
    if a.batch % (a.nproc * a.micro):
        fail(f"--batch {a.batch} does not split into --nproc {a.nproc} x --micro {a.micro}")
    from fourfold.data import prepare
    from fourfold.plan.perf import sequence_cost

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_texts(root / "texts.jsonl", a.texts, a.seq)
        prepare([root / "texts.jsonl"], root / "data", val_fraction=0.01, progress=False)
        cost = sequence_cost(model_config(a.seq), a.seq)
        header(f"Packed rows over {a.nproc} data-parallel ranks: dealt in order or balanced by "
               "cost",
               f"{a.texts} texts of Pareto(1) x 40 bytes (at most {a.seq}), packed into rows "
               f"of {a.seq}; global batch {a.batch} rows, {a.micro} micro-batches a rank; "
               f"model dim 64, 2 layers (attention / GEMMs on a whole row: "
               f"{cost.square * a.seq / cost.token:.1f}x); {a.steps - 1} steps of each way, "
               "taking turns; imbalance: the dearest rank over the mean, median (worst) over "
               "the steps")
        out = root / "result.json"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(a.nproc), __file__, "--worker", "--data",
                str(root / "data"), "--out", str(out), "--seq", str(a.seq), "--batch",
                str(a.batch), "--micro", str(a.micro), "--steps", str(a.steps)]
        proc = subprocess.run(argv, env=job_env(OMP_NUM_THREADS="1"), capture_output=True,
                              text=True)
        if proc.returncode != 0:
            fail(f"the ranks' job failed:\n{proc.stderr[-3000:]}")
        found = json.loads(out.read_text())
    table = Table("rows dealt", "predicted imbalance", "measured imbalance (CPU s)",
                  "step s (median)", "vs in order")
    base = statistics.median(found["in order"]["step"])
    for way, values in found.items():
        def spread(xs: list[float]) -> str:
            return f"{statistics.median(xs):.1%} ({max(xs):.1%})"

        step = statistics.median(values["step"])
        table.row(way, spread(values["predicted"]), spread(values["measured"]),
                  f"{step:.2f}", f"{step / base:.2f}x")


if __name__ == "__main__":
    main()
