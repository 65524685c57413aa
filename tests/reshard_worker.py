"""Run by torchrun (2 ranks) from test_method_reshard.py: each training method's checkpoint on
other grids. Rank 0 writes a JSON list of results to $FOURFOLD_TEST_OUT.

For every method of METHODS, with the one-process run the test wrote under $FOURFOLD_TEST_DIR/one
(a checkpoint after step SAVE_AT, the method's full state then, the uninterrupted losses):
  x2  resume the one-process checkpoint on x = 2: the loaded state is this rank's block of the
      saved full state, bit for bit; train on to STEPS (losses, weights)
  z2  train afresh on z = 2 with a checkpoint after SAVE_AT (written in the background),
      writing the full state then (gathered) for the test's one-process resume; train on
  y2  resume the z = 2 checkpoint on y = 2 (grid to grid): state bit for bit, train on
and once, for a method state without a layout (GaLore's, its state_layout patched to None):
  perrank  written on z = 2; resumed on z = 2 it loads (bit for bit); on y = 2 it is refused
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BASE = ["model.preset=debug", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=128", "train.batch_size=8", "train.seq_len=32", "train.steps=6",
        "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=0",
        "train.sample_tokens=0", "train.log_every=1", "checkpoint.keep=0"]
# blockllm reselects every other step and galore refreshes its projection after the resume
METHODS = {"lomo": ["train.method.clip_mode=none"], "adalomo": [],
           "mezo": ["train.lr=1e-4", "train.grad_clip=0"],
           "es": ["train.lr=1e-4", "train.grad_clip=0", "train.method.population=4"],
           "blockllm": ["train.method.sparsity=0.5", "train.method.patience=1"],
           "galore": ["train.method.gap=2"]}
STEPS, SAVE_AT = 6, 3


def config(method: str, *extra: str) -> Any:
    from fourfold.config import load_config

    return load_config(None, [*BASE, f"train.optimizer={method}", *METHODS[method], *extra])


def state_mismatches(method: Any, grid: Any, full: dict[str, torch.Tensor]) -> list[str]:
    """Keys of the method's state whose tensor on this rank is not exactly its block of `full`
    (a state with other keys: all of them)."""
    tensors, _ = method.state_dict()
    if set(tensors) != set(full):
        return sorted(set(tensors) ^ set(full))
    bad = []
    coords = grid.shape.coords(grid.rank)
    for key, t in tensors.items():
        layout = method.state_layout(key)
        want = full[key] if t.dim() == 0 or layout is None else layout.shard(full[key],
                                                                             grid.shape, coords)
        if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t, want):
            bad.append(key)
    return bad


def full_state(method: Any, pmodel: Any) -> dict[str, torch.Tensor]:
    """The method's state as full tensors (collective on a grid)."""
    from fourfold.parallel.parallelize import _gather_full

    tensors, _ = method.state_dict()
    out = {}
    for key, t in tensors.items():
        layout = method.state_layout(key)
        out[key] = (t if t.dim() == 0 or layout is None else
                    _gather_full(t.contiguous(), layout, pmodel.comm)).detach().clone()
    return out


def train_on(trainer: Any, until: int) -> list[float]:
    return [trainer.train_step().loss for _ in range(until - trainer.step)]


def max_weight_diff(pmodel: Any, ref: dict[str, torch.Tensor]) -> float:
    state = pmodel.full_state_dict()
    return max(float((state[k] - ref[k]).abs().max()) for k in ref)


def copy_run(src: Path, dst: Path) -> None:
    """A copy of a run directory (rank 0), seen by every rank."""
    distributed = dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    if distributed:
        dist.barrier()


def resume(method: str, src: Path, dst: Path, grid: str, full: dict[str, torch.Tensor],
           ref: dict) -> dict:
    """Resume `src`'s checkpoint on `grid` (in a copy, dst): the facts the test checks."""
    from safetensors.torch import load_file

    from fourfold.train import Trainer

    copy_run(src, dst)
    trainer = Trainer(config(method, grid), dst, progress=False)
    result = {"step": trainer.step,
              "bad_state": state_mismatches(trainer.method, trainer.grid, full),
              "meta": trainer.method.state_dict()[1]}
    result["losses"] = train_on(trainer, STEPS)
    weights = load_file(str(Path(ref["weights"])))
    result["max_weight_diff"] = max_weight_diff(trainer.pmodel, weights)
    trainer.checkpoints.close()
    return result


def fresh_with_checkpoint(method: str, run_dir: Path, grid: str) -> tuple[dict, dict]:
    """Train on `grid` with a checkpoint after SAVE_AT, written in the background while the
    training goes on (its snapshot must be the state at SAVE_AT); the full state then, and the
    facts."""
    from fourfold.train import Trainer

    trainer = Trainer(config(method, grid, "checkpoint.async=true"), run_dir, progress=False)
    losses = train_on(trainer, SAVE_AT)
    trainer.save_checkpoint()
    full = full_state(trainer.method, trainer.pmodel)
    meta = trainer.method.state_dict()[1]
    losses += train_on(trainer, STEPS)
    trainer.checkpoints.close()
    return full, {"losses": losses, "meta": meta}


def run_method(method: str, root: Path) -> dict:
    from safetensors.torch import load_file, save_file

    one = root / "one"
    ref = json.loads((one / f"{method}.json").read_text())
    saved = load_file(str(one / f"{method}.state.safetensors"))
    out: dict[str, Any] = {"x2": resume(method, one / method, root / "grid" / f"{method}_x2",
                                        "parallel.x=2", saved, ref)}
    full, out["z2"] = fresh_with_checkpoint(method, root / "grid" / f"{method}_z2",
                                            "parallel.z=2")
    out["z2"]["state_vs_one_process"] = {
        k: float((v.abs() - saved[k].abs()).abs().max() / saved[k].abs().max().clamp(min=1e-30))
        for k, v in full.items() if v.dim()}
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()},
                  str(root / "grid" / f"{method}_z2.state.safetensors"))
        (root / "grid" / f"{method}_z2.json").write_text(json.dumps(out["z2"]["meta"]))
    out["y2"] = resume(method, root / "grid" / f"{method}_z2", root / "grid" / f"{method}_y2",
                       "parallel.y=2", full, ref)
    return out


def run_per_rank(root: Path) -> dict:
    """A method state without a layout: kept per rank, read back on its own grid only."""
    from fourfold.train import Trainer, TrainingError
    from fourfold.train.methods.galore import GaLore

    GaLore.state_layout = lambda self, key: None  # type: ignore[method-assign]
    try:
        run_dir = root / "grid" / "perrank_z2"
        trainer = Trainer(config("galore", "parallel.z=2"), run_dir, progress=False)
        train_on(trainer, SAVE_AT)
        trainer.save_checkpoint()
        trainer.checkpoints.close()
        mine = {k: v.detach().clone() for k, v in trainer.method.state_dict()[0].items()}
        copy_run(run_dir, root / "grid" / "perrank_z2_again")
        again = Trainer(config("galore", "parallel.z=2"), root / "grid" / "perrank_z2_again",
                        progress=False)
        result: dict[str, Any] = {"same_grid_step": again.step,
                                  "same_grid_bad": state_mismatches(again.method, again.grid,
                                                                    mine)}
        copy_run(run_dir, root / "grid" / "perrank_y2")
        try:
            Trainer(config("galore", "parallel.y=2"), root / "grid" / "perrank_y2",
                    progress=False)
            result["refusal"] = None
        except TrainingError as e:
            result["refusal"] = str(e)
        return result
    finally:
        del GaLore.state_layout


def main() -> None:
    from fourfold.parallel import init_distributed, leave_job

    torch.set_num_threads(1)
    init_distributed("gloo", timeout_s=120)
    root = Path(os.environ["FOURFOLD_TEST_DIR"])
    results: dict[str, Any] = {}
    for method in METHODS:
        results[method] = run_method(method, root)
    results["perrank"] = run_per_rank(root)
    if dist.get_rank() == 0:
        Path(os.environ["FOURFOLD_TEST_OUT"]).write_text(json.dumps(results))
    dist.barrier()
    leave_job(0)


if __name__ == "__main__":
    main()
