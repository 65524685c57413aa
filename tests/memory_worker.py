"""Measure the activation memory of the parallelized `debug` model: the bytes of the tensors
autograd saves for backward during one forward, counted once per storage, parameters and
buffers (weight shards, RoPE tables) excluded. Run by torchrun from test_memory_model.py and
bench/memory.py (one launch checks every grid of its world size), or alone for one process.

Each case writes one JSON line: the grid (data, z, y, x), checkpointing on/off, tokens per rank,
the measured bytes of the model body (embedding, blocks, final norm, output-layer input), of
one block at its largest, and of the loss; and the planner's predicted activation bytes.

With activation checkpointing, autograd keeps only each block's input during forward; backward
recomputes one block at a time with its full activations. The measured peak is therefore the
checkpointed forward's saved bytes plus the largest block's full saved bytes (measured on the
same grid without checkpointing: the recomputation runs the very same block forward).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold.config import ParallelConfig, model_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, init_distributed, leave_job, parallelize
from fourfold.plan.memory import Precision, predict_memory

SEQ = 64  # tokens per sequence
SEQS_PER_RANK = 2  # sequences per (data, z) shard per micro-step


class SavedTensorCounter:
    """Bytes autograd saves for backward, by phase (the caller names the current phase)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude  # storage pointers of parameters and buffers
        self.phase = "body"
        self.by_storage: dict[int, tuple[str, int]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude and ptr not in self.by_storage:
            self.by_storage[ptr] = (self.phase, storage.nbytes())
        return t  # the graph keeps the tensor alive, so no pointer is reused while counting

    def total(self, prefix: str = "") -> int:
        return sum(n for phase, n in self.by_storage.values() if phase.startswith(prefix))

    def phases(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for phase, n in self.by_storage.values():
            out[phase] = out.get(phase, 0) + n
        return out


def measure(shape: GridShape, grid: Grid, ckpt: bool) -> dict:
    """Saved bytes of one forward of the parallelized debug model on this rank."""
    cfg = model_config("debug")
    model = build_model(cfg, seed=7)
    model.activation_checkpointing = ckpt
    pcfg = ParallelConfig(x=shape.x, y=shape.y, z=shape.z, data=shape.data)
    pmodel = parallelize(model, grid, pcfg)
    pmodel.train()
    module = pmodel.module
    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in module.buffers()}
    counter = SavedTensorCounter(exclude)

    def enter(name: str):
        def hook(_module, inputs) -> None:
            counter.phase = name
            if ckpt and name.startswith("body/layer"):
                # a checkpointed block keeps its input for the backward (held by the block's
                # recompute, not through autograd's saved tensors: counted here, as
                # train.memory_report counts it)
                counter.pack(inputs[0])
        return hook

    handles = [layer.register_forward_pre_hook(enter(f"body/layer{i}"))
               for i, layer in enumerate(module.layers)]
    handles.append(module.norm.register_forward_pre_hook(enter("body/head")))
    g = torch.Generator().manual_seed(1 + grid.batch_shard[0])
    tokens = torch.randint(0, cfg.vocab_size, (SEQS_PER_RANK, SEQ + 1), generator=g)
    counter.phase = "body/embed"
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        logits = pmodel(tokens[:, :-1])
        counter.phase = "loss"
        loss = pmodel.criterion(logits, tokens[:, 1:]).mean()
    for h in handles:
        h.remove()
    loss.backward()  # leaves the engine's communication state clean for the next case
    pmodel.finish_backward()
    phases = counter.phases()
    n = SEQS_PER_RANK * SEQ
    predicted = predict_memory(cfg, shape, n, ckpt, Precision.of("float32"))
    return {"body": counter.total("body"), "loss": counter.total("loss"),
            "block_max": max(phases.get(f"body/layer{i}", 0) for i in range(cfg.n_layers)),
            "phases": phases, "tokens": n, "predicted": predicted.activations,
            "predicted_logits": predicted.logits}


def run_cases(shape: GridShape, grid: Grid) -> list[dict]:
    """Both checkpointing settings on one grid; the checkpointed peak adds one full block."""
    full = measure(shape, grid, ckpt=False)
    ckpt = measure(shape, grid, ckpt=True)
    out = []
    for on, m in ((False, full), (True, ckpt)):
        measured = m["body"] + (full["block_max"] if on else 0)
        out.append({"shape": [shape.data, shape.z, shape.y, shape.x], "ckpt": on,
                    "tokens": m["tokens"], "measured": measured, "predicted": m["predicted"],
                    "loss_saved": m["loss"], "predicted_logits": m["predicted_logits"],
                    "phases": m["phases"]})
    return out


def main() -> None:
    rank, world, device = init_distributed("gloo", timeout_s=120)
    shapes = json.loads(os.environ["FOURFOLD_MEM_SHAPES"])
    out_path = os.environ["FOURFOLD_MEM_OUT"]
    results: list[dict] = []
    for shape_list in shapes:
        shape = GridShape(*shape_list)
        if shape.size != world:
            continue
        grid = Grid.build(shape, device) if world > 1 else Grid.single()
        try:
            cases = run_cases(shape, grid)
        except Exception:  # noqa: BLE001  reported to the caller, which fails with the traceback
            cases = [{"shape": shape_list, "error": traceback.format_exc()}]
        # every rank's numbers: ranks of one grid may hold different shares
        gathered = [cases]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, cases)
        if rank == 0:
            for r, rank_cases in enumerate(gathered):
                for c in rank_cases:
                    results.append(dict(c, rank=r))
    if rank == 0:
        with open(out_path, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    if world > 1:
        dist.barrier()
    leave_job(0)


def launch(nproc: int, grids: list, out: Path, timeout_s: float = 600
           ) -> tuple[list[dict] | None, str]:
    """Run this worker on `nproc` ranks (torchrun when more than one) over `grids`; returns
    (its JSON lines, or None when the launch failed, and the launch's stderr)."""
    env = dict(os.environ, FOURFOLD_MEM_SHAPES=json.dumps(grids), FOURFOLD_MEM_OUT=str(out),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if proc.returncode != 0:
        return None, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stderr


if __name__ == "__main__":
    main()
