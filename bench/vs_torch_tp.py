"""fourfold against PyTorch's own tensor parallelism on this CPU, same model, same rank count:
torch.distributed.tensor.parallel column/row-wise plans (Megatron-style 1D tensor parallelism),
with FSDP2 fully_shard over the data axis when there is one. Prints step time and bytes moved per
step per rank (fourfold: its ledger; PyTorch: the closed-form count of what its plan issues).
fourfold's rows are bench/grids.py's, on a few grids of the same rank count.

    python bench/vs_torch_tp.py [--nproc 4] [--layers 2 --dim 512 --seq 256 --batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, fail, header, job_env, mib, parser  # noqa: E402
from grids import MODEL_ARGS, add_model_args, model_config, run_grids  # noqa: E402


def parse() -> argparse.Namespace:
    ap = parser(__doc__)
    add_model_args(ap)
    ap.set_defaults(nproc=4, dim=512, ffn=1536, vocab=8192, seq=256, batch=8, steps=4)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


# fourfold's rows: these grids of each rank count, run by bench/grids.py (data x z x y x x)
FOURFOLD_GRIDS = {2: "1x1x2x1,1x1x1x2,1x2x1x1",
                  4: "1x1x4x1,1x1x2x2,1x2x2x1,2x1x2x1",
                  8: "2x1x4x1,2x1x2x2,1x2x2x2,2x2x2x1"}


def torch_tp_bytes(cfg, tp: int, dp: int, tokens: int, local_params: int) -> dict[str, int]:
    """What the column/row-wise plan issues per step per rank (fp32): forward, one all-reduce
    of (tokens, dim) after each row-wise layer (o, down) and the embedding; backward, one for
    the input gradient of each column-wise group (q/k/v, gate/up, output). FSDP2 over data:
    all-gather of the parameters in forward and again in backward, reduce-scatter of grads."""
    act = tokens * cfg.dim * 4
    tp_bytes = (cfg.n_layers * 4 + 2) * act if tp > 1 else 0
    data = 0
    if dp > 1:
        data = local_params * 4 * 3  # 2 all-gathers (output) + 1 reduce-scatter (input)
    return {"tensor": tp_bytes, "data": data}


def time_steps(step, steps: int) -> float:
    import torch.distributed as dist
    times = []
    for i in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(i)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def clip_mixed(model, max_norm: float, tp: int, dp: int) -> None:
    """Gradient clipping over DTensor shards and plain (replicated) tensors alike, the way
    torchtitan does it for a plan that leaves norms replicated."""
    import torch
    import torch.distributed as dist
    sq = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for g in grads:
        if hasattr(g, "to_local"):
            placements = g.placements
            local = g.to_local().double().pow(2).sum()
            replicas = 1
            for mesh_size, pl in zip(g.device_mesh.shape, placements):
                replicas *= 1 if pl.is_shard() else mesh_size
            sq += local / replicas
        else:
            sq += g.double().pow(2).sum() / (tp * dp)
    dist.all_reduce(sq)
    coef = max_norm / (float(sq.sqrt()) + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   loss_parallel, parallelize_module)

    from fourfold.models import build_model
    from fourfold.parallel import init_distributed, leave_job

    rank, world, _ = init_distributed("gloo", 600)
    torch.set_num_threads(1)
    cfg = model_config(a)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g)
            for _ in range(a.steps)]
    rows = []

    # --- PyTorch tensor parallelism (+ FSDP2 over data)
    for tp, dp in ((world, 1), (world // 2, 2)):
        if tp < 2:
            continue
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = build_model(cfg, seed=1)
        for block in model.layers:
            parallelize_module(block, mesh["tp"], {
                "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                "ffn.gate_proj": ColwiseParallel(), "ffn.up_proj": ColwiseParallel(),
                "ffn.down_proj": RowwiseParallel()})
        parallelize_module(model, mesh["tp"], {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        if dp > 1:
            from torch.distributed.fsdp import fully_shard
            for block in model.layers:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dp_rank = mesh["dp"].get_local_rank()
        b = a.batch // dp

        def tstep(i: int) -> None:
            local = data[i][dp_rank * b:(dp_rank + 1) * b]
            logits = model(local[:, :-1])
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), local[:, 1:].flatten(), reduction="sum") / (a.batch * a.seq)
                loss.backward()
            clip_mixed(model, 1.0, tp, dp)
            opt.step()
            opt.zero_grad(set_to_none=True)

        t = time_steps(tstep, a.steps)
        local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                           for p in model.parameters())
        counted = torch_tp_bytes(cfg, tp, dp, b * a.seq, local_params * (dp if dp > 1 else 1))
        rows.append({"who": "torch TP" + (" + FSDP2" if dp > 1 else ""),
                     "grid": f"dp{dp} tp{tp}", "step_s": t,
                     "bytes": counted["tensor"] + counted["data"]})

    if rank == 0:
        Path(a.worker).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.barrier()
    leave_job(0)  # destroy the process group, flush, os._exit


def main() -> None:
    a = parse()
    if a.worker:
        worker(a)
        return
    if a.nproc not in FOURFOLD_GRIDS:
        fail(f"--nproc {a.nproc}: choose from {', '.join(map(str, FOURFOLD_GRIDS))}")
    if a.dtype != "float32" or a.activation_checkpointing:
        fail("PyTorch's rows run float32 without activation checkpointing; leave out --dtype "
             "and --activation-checkpointing")
    header("fourfold's grids against PyTorch's tensor parallelism and FSDP2",
           f"{a.nproc} ranks, {a.layers} layers, dim {a.dim}, ffn {a.ffn}, vocabulary {a.vocab}, "
           f"batch {a.batch} x {a.seq}, float32")
    rows = []
    for r in run_grids(argparse.Namespace(**{**vars(a), "grids": FOURFOLD_GRIDS[a.nproc]})):
        d, z, y, x = r["grid"]
        rows.append({"who": "fourfold", "grid": f"d{d} z{z} y{y} x{x}", "step_s": r["step_s"],
                     "bytes": sum(r["bytes"][axis] for axis in ("x", "y", "z", "data"))})
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"fourfold-vs-tp-{os.getpid()}.jsonl"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(a.nproc), __file__, "--worker", str(out)]
    for name in MODEL_ARGS:
        argv += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
    proc = subprocess.run(argv, env=job_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        fail(f"PyTorch's job failed:\n{proc.stderr[-3000:]}")
    rows += [json.loads(line) for line in out.read_text().splitlines()]
    out.unlink()
    table = Table("framework", "grid", "step s", "MiB per step per rank")
    for r in rows:
        table.row(r["who"], r["grid"], f"{r['step_s']:.3f}", mib(r["bytes"], 2))


if __name__ == "__main__":
    main()
