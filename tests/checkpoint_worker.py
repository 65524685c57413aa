"""Run by torchrun from test_checkpoint.py. One launch checks several things and writes one JSON
object (rank 0) to $FOURFOLD_TEST_OUT.

FOURFOLD_TEST_PHASE=save: train STEPS steps on the grid $FOURFOLD_TEST_SHAPE with a checkpoint
  after step SAVE_AT (asynchronous); record the losses and the full weights at SAVE_AT; then a
  fresh model loads the checkpoint and trains on: its losses must equal the uninterrupted ones
  bit for bit. Also checks that DTensor's offsets for every parameter equal Layout.offsets.
FOURFOLD_TEST_PHASE=load: on another grid, load the checkpoint written by `save`, compare the
  gathered weights with the saved full weights, train on (losses within float tolerance of the
  uninterrupted run), then stop-and-resume on this grid (bit for bit), and load a Hugging Face
  checkpoint with load_hf_into (logits against the reference written by the test).
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold.config import CheckpointConfig, ParallelConfig, TrainConfig, model_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, init_distributed, leave_job, parallelize
from fourfold.models.hf import load_hf_into
from fourfold.train.checkpoint import (CheckpointManager, build_mesh, placements_for,
                                       verify_checkpoint)
from fourfold.train.optim import build_optimizer

STEPS = 5  # with SAVE_AT = 3 and checkpoint.every = SAVE_AT: one checkpoint
SAVE_AT = 3
BATCH = 8
SEQ = 16
MODEL = model_config("debug", bias=True)


def build(grid: Grid, seed: int):
    model = build_model(MODEL, seed=seed)
    pmodel = parallelize(model, grid, ParallelConfig(bucket_mb=0.05))
    optimizer = build_optimizer(pmodel.named_parameters(), TrainConfig(lr=1e-2))
    return pmodel, optimizer


def train_step(pmodel, optimizer, step: int) -> float:
    """One AdamW step on a batch that depends only on the step number."""
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(1000 + step))
    index, count = pmodel.grid.batch_shard
    b = BATCH // count
    local = tokens[index * b:(index + 1) * b]
    global_count = pmodel.reduce_over_batch(torch.tensor(float(local[:, 1:].numel())))
    loss = pmodel(local[:, :-1], local[:, 1:]).sum() / global_count
    loss.backward()
    pmodel.finish_backward()
    pmodel.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(pmodel.reduce_over_batch(loss.detach()))


def offsets_match(pmodel, grid: Grid) -> list[str]:
    """Parameters whose DTensor local shape/offset differ from the engine's Layout."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = build_mesh(grid)
    coords = grid.shape.coords(grid.rank)
    bad = []
    full = pmodel.full_state_dict()
    for name, layout in pmodel.layouts().items():
        shape = tuple(full[name].shape)
        local, offset = compute_local_shape_and_global_offset(
            shape, mesh, placements_for(layout, len(shape), name))
        if (tuple(local), tuple(offset)) != (layout.local_shape(shape, grid.shape),
                                              layout.offsets(shape, grid.shape, coords)):
            bad.append(name)
    return bad


def phase_save(grid: Grid, run_dir: Path, out_dir: Path) -> dict:
    result: dict = {"split_params": 0}
    pmodel, optimizer = build(grid, seed=7)
    result["split_params"] = sum(1 for l in pmodel.layouts().values() if l.split_axes)
    result["bad_offsets"] = offsets_match(pmodel, grid)
    manager = CheckpointManager.for_model(
        run_dir, CheckpointConfig(every=SAVE_AT, keep=2, async_save=True), grid, pmodel, optimizer)
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(train_step(pmodel, optimizer, step))
        if manager.due(step):
            manager.save(step, {"step": step})
            full = pmodel.full_state_dict()  # the weights the checkpoint must hold
            if grid.rank == 0:
                torch.save(full, out_dir / "full_at_save.pt")
    manager.close()
    result["losses"] = losses

    # stop and resume on the same grid: a model with other weights loads the checkpoint
    resumed, resumed_opt = build(grid, seed=8)
    path = manager.latest_valid()
    result["loaded_path"] = str(path)
    extra = CheckpointManager.for_model(run_dir, CheckpointConfig(), grid, resumed,
                                        resumed_opt).load(path)
    result["extra_step"] = extra["step"]
    result["resumed_losses"] = [train_step(resumed, resumed_opt, s)
                                for s in range(extra["step"] + 1, STEPS + 1)]
    return result


def phase_load(grid: Grid, run_dir: Path, out_dir: Path, save_dir: Path) -> dict:
    result: dict = {}
    pmodel, optimizer = build(grid, seed=8)
    source = CheckpointManager.for_model(save_dir, CheckpointConfig(), grid, pmodel, optimizer)
    path = source.latest_valid()
    extra = source.load(path)
    expected = torch.load(out_dir / "full_at_save.pt")
    full = pmodel.full_state_dict()
    result["max_weight_diff"] = max(float((full[k] - expected[k]).abs().max()) for k in expected)
    result["extra_step"] = extra["step"]
    losses = [train_step(pmodel, optimizer, s) for s in range(extra["step"] + 1, STEPS + 1)]
    result["continued_losses"] = losses

    # stop and resume on this grid (synchronous save this time)
    pmodel, optimizer = build(grid, seed=8)
    CheckpointManager.for_model(save_dir, CheckpointConfig(), grid, pmodel, optimizer).load(path)
    manager = CheckpointManager.for_model(
        run_dir, CheckpointConfig(every=1, keep=1, async_save=False), grid, pmodel, optimizer)
    for step in range(extra["step"] + 1, extra["step"] + 2):
        train_step(pmodel, optimizer, step)
        manager.save(step, {"step": step})
    resumed, resumed_opt = build(grid, seed=9)
    resumed_extra = CheckpointManager.for_model(run_dir, CheckpointConfig(), grid, resumed,
                                                resumed_opt).load(manager.latest_valid())
    result["resumed_losses"] = [train_step(resumed, resumed_opt, s)
                                for s in range(resumed_extra["step"] + 1, STEPS + 1)]

    # a file that only rank 1 hashes is damaged (same size): every rank must skip the checkpoint
    newest = manager.latest_valid()
    names = sorted(json.loads((newest / "manifest.json").read_text())["files"])
    victim = newest / next(n for i, n in enumerate(names) if i % grid.world_size == 1)
    if grid.rank == 0:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    # the damage is real and in rank 1's share of the hashing alone: only the ranks' agreement
    # keeps the others from taking the checkpoint
    result["damage_seen_by"] = [share for share in range(grid.world_size)
                                if verify_checkpoint(newest, (share, grid.world_size))]
    fresh = CheckpointManager(run_dir, CheckpointConfig(), grid)
    result["after_damage"] = str(fresh.latest_valid())

    # every rank's step time reaches every rank, in rank order
    from fourfold.parallel.comm import Comm
    from fourfold.train.resilience import gather_step_times

    result["step_times"] = gather_step_times(0.25 + grid.rank, Comm(grid))

    # Hugging Face checkpoint, read slice by slice
    hf_dir = Path(os.environ["FOURFOLD_TEST_HF"])
    from fourfold.models.hf import hf_model_config

    hf_cfg = hf_model_config(hf_dir)
    model = build_model(hf_cfg, seed=123)
    hf_pmodel = parallelize(model, grid)
    load_hf_into(hf_pmodel, hf_dir)
    reference = torch.load(hf_dir / "reference.pt")
    with torch.no_grad():
        logits = hf_pmodel(reference["tokens"])  # (B, T, V/Gy): this rank's vocabulary shard
    vocab_shard = hf_cfg.vocab_size // grid.size("y")
    start = grid.coord("y") * vocab_shard
    want = reference["logits"][..., start:start + vocab_shard]
    result["hf_logits_max_diff"] = float((logits - want).abs().max())
    result["hf_logits_scale"] = float(want.abs().max())
    result["hf_logits_shape_ok"] = tuple(logits.shape) == tuple(want.shape)
    return result


def main() -> int:
    rank, world, device = init_distributed("gloo", timeout_s=120)
    shape = GridShape(*json.loads(os.environ["FOURFOLD_TEST_SHAPE"]))
    out_dir = Path(os.environ["FOURFOLD_TEST_OUT"])
    phase = os.environ["FOURFOLD_TEST_PHASE"]
    grid = Grid.build(shape, device)
    try:
        if phase == "save":
            result = phase_save(grid, out_dir / "run_save", out_dir)
        else:
            result = phase_load(grid, out_dir / f"run_load_{world}", out_dir,
                                out_dir / "run_save")
        result["ok"] = True
    except Exception:  # reported to the test, which fails with the traceback
        result = {"ok": False, "error": traceback.format_exc()}
    results: list = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        (out_dir / f"{phase}_{world}.json").write_text(json.dumps(results))
    dist.barrier()
    leave_job(0)  # destroy the process group, flush, os._exit


if __name__ == "__main__":
    main()
