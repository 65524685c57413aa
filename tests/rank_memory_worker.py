"""Peak resident memory of each rank (VmHWM), less the peak of the same process after it has
only imported fourfold. Run by torchrun (or alone, for one process) from test_shard_build.py
and bench/memory.py; rank 0 writes one JSON line per rank.

Modes (FOURFOLD_RANK_MEM_MODE):
  build   build the model as the trainer does (sharded: on the meta device, then parallelize),
          then write model.safetensors by streaming; the numbers: after the build, and peak
  whole   build the whole model on this rank, then parallelize (what the trainer did before
          building in shards)
  train   fourfold's Trainer on the config in FOURFOLD_RANK_MEM_CONFIG (a few steps, a
          checkpoint and the final export)
  steps   for each case of FOURFOLD_RANK_MEM_MODEL's "cases" (model, train, batch): build
          on the grid and run its "steps" (2) steps of train.optimizer (run_method_steps);
          the number: the heap in use at its peak (HeapPeak), from before the build, in
          the second of two identical runs
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# the baseline: a process that has imported fourfold, the trainer and what it loads at import
# (torch.distributed.checkpoint only at a run's first checkpoint: the planner's library_bytes)
import fourfold.cli  # noqa: F401
import fourfold.train.checkpoint  # noqa: F401
import fourfold.train.trainer  # noqa: F401
import torch
import torch.distributed as dist
import torch.utils._python_dispatch

from fourfold.config import ModelConfig, ParallelConfig, TrainConfig, load_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, init_distributed, leave_job, parallelize
from fourfold.train.build import cpu_has_bfloat16_gemm
from fourfold.train.metrics import peak_memory_bytes


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def vm_hwm() -> int:
    """Peak resident set of this process so far, in bytes: VmHWM, read as a run's summary
    reads it (fourfold.train.metrics)."""
    return peak_memory_bytes(torch.device("cpu"))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.lru_cache(maxsize=None)
def _mallinfo2() -> Any:
    """glibc's mallinfo2, looked up once (find_library runs ldconfig: far slower than the
    call itself, which samplers make every millisecond); None off glibc."""
    try:
        f = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = _Mallinfo2
    return f


def _heap() -> tuple[int, int]:
    """(bytes malloc has handed out and not had back, bytes it holds from the kernel: heap
    arenas plus mmapped blocks), over all arenas; (-1, -1) off glibc."""
    f = _mallinfo2()
    if f is None:
        return -1, -1
    m = f()
    return m.uordblks + m.hblkhd, m.arena + m.hblkhd


class HeapPeak(torch.utils._python_dispatch.TorchDispatchMode):
    """glibc's heap in use (mallinfo2) after every aten op: the most tensor bytes alive at
    once on a CPU process, as a GPU's max_memory_allocated counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.float32_gemms = not cpu_has_bfloat16_gemm()

    def __enter__(self) -> "HeapPeak":
        # earlier work's cyclic garbage (a test's models) freed during the run would read as
        # a lower peak: in one pytest process after 170 tests, AdamW's read 29% low
        gc.collect()
        self.start = self.peak = _heap()[0]
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.float32_gemms and func in BFLOAT16_GEMMS and _any_bfloat16(args):
            out = _gemm_in_float32(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        self.peak = max(self.peak, _heap()[0])
        return out


# On a CPU without bfloat16 matrix instructions torch's bfloat16 GEMMs take a generic loop,
# 10-100x slower than float32's (and slowest for a plain weight @ gradient, backward's dX).
# HeapPeak reads the heap between ops, so a GEMM computed in float32 and rounded to a
# bfloat16 output of the same shape and strides leaves every reading as it was: the inputs'
# float32 copies come and go inside the op.
BFLOAT16_GEMMS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                            torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default})


def _any_bfloat16(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args)


def _gemm_in_float32(func, args: tuple, kwargs: dict) -> torch.Tensor:
    wide = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a
            for a in args]
    out = func(*wide, **kwargs)
    return out.to(torch.bfloat16)


def run_method_steps(model_cfg: ModelConfig, grid: Grid, cfg: TrainConfig, batch: int,
                     steps: int = 2) -> int:
    """Build `model_cfg` on `grid` (on the meta device, then each rank's shards), run `steps`
    steps of cfg.optimizer on one random batch of cfg.seq_len tokens (the forward under
    autocast where cfg.dtype is bfloat16, as the trainer runs it), and return the heap's peak
    in use above its start, in bytes: of the second of two such runs, so that what libraries
    keep from their first use is not in it. MKL keeps a pool of buffers sized by the largest
    GEMMs it has run (about 40 MiB for the small preset's: a first run read 135 MiB in use
    against 103 for the next one; 104 with MKL_DISABLE_FAST_MM=1, which costs a fifth of the
    tokens/s), and torch._dynamo (about 44 MiB of heap) is imported by torch.optim (AdamW)
    and by HeapPeak's own dispatch mode through torch's Python meta kernels. The planner's
    host runtime term is where such memory counts in a run's resident memory."""
    from fourfold.methods import method_spec
    from fourfold.train.methods import StepData, build_method

    shape, seq = grid.shape, cfg.seq_len
    for _ in range(2):  # the same run twice, both under HeapPeak (whose mode counts)
        with HeapPeak() as heap:
            model = build_model(model_cfg, seed=0, device="meta")
            model.activation_checkpointing = True
            pmodel = parallelize(model, grid, ParallelConfig(x=shape.x, y=shape.y, z=shape.z,
                                                             data=shape.data),
                                 blocked_loss=method_spec(cfg.optimizer).blocked_loss)
            method = build_method(pmodel, cfg)
            tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq + 1),
                                   generator=torch.Generator().manual_seed(0))
            for _ in range(steps):
                method.step(pmodel, StepData.one_batch(pmodel, tokens, cfg.dtype), 1e-4)
            del model, pmodel, method, tokens
    return heap.peak - heap.start


class Phases:
    """VmRSS, VmHWM and glibc's heap in use / held at named points of a run (FOURFOLD_RANK_MEM_
    PHASES=1): where a rank's peak comes from. Records (name, rss, hwm, heap_used, heap_held,
    rss_file: the resident pages of mapped files, i.e. libraries' code and data)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, int, int, int, int]] = []

    def mark(self, name: str) -> None:
        used, held = _heap()
        self.rows.append((name, _status("VmRSS"), vm_hwm(), used, held, _status("RssFile")))

    def wrap(self, owner: object, attr: str, name: str, before: bool = False) -> None:
        inner = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            if before:
                self.mark("before " + name)
            out = inner(*args, **kwargs)
            self.mark(name)
            return out

        setattr(owner, attr, wrapped)


def instrument_trainer_build(phases: Phases) -> None:
    """Marks inside build_run: after the grid, the sharded model and the optimizer."""
    from fourfold.parallel.grid import Grid as GridClass
    from fourfold.train import build

    phases.wrap(build, "init_distributed", "init_distributed")
    build_grid = GridClass.build

    def grid_build(*args, **kwargs):
        out = build_grid(*args, **kwargs)
        phases.mark("Grid.build")
        return out

    GridClass.build = staticmethod(grid_build)  # type: ignore[method-assign]
    phases.wrap(build, "parallelize", "parallelize")
    phases.wrap(build, "build_method", "build_method")


def instrument_trainer_run(phases: Phases, trainer: object) -> None:
    """Marks inside fit: each forward, backward, gradient clip, optimizer step, checkpoint
    (snapshot, wait) and the export."""
    import fourfold.train.trainer as trainer_module

    phases.wrap(trainer.pmodel.module, "forward", "forward")
    phases.wrap(trainer.pmodel, "finish_backward", "backward")
    phases.wrap(trainer.pmodel, "clip_grad_norm_", "clip_grad_norm")
    if trainer.method.name == "adamw":
        phases.wrap(trainer.method.optimizer, "step", "optimizer.step")
    phases.wrap(trainer.checkpoints, "save", "checkpoint.save")
    phases.wrap(trainer.checkpoints, "wait", "checkpoint.wait")
    phases.wrap(trainer_module, "save_weights_streamed", "export", before=True)


def main() -> None:
    baseline = vm_hwm()
    mode = os.environ["FOURFOLD_RANK_MEM_MODE"]
    out_path = Path(os.environ["FOURFOLD_RANK_MEM_OUT"])
    record: dict = {"mode": mode, "baseline": baseline}
    phases = Phases() if os.environ.get("FOURFOLD_RANK_MEM_PHASES") == "1" else None
    if phases is not None:
        phases.mark("import")
    if mode == "train":
        from fourfold.train import Trainer

        cfg = load_config(os.environ["FOURFOLD_RANK_MEM_CONFIG"])
        if phases is not None:
            instrument_trainer_build(phases)
        trainer = Trainer(cfg, os.environ["FOURFOLD_RANK_MEM_RUN"], progress=False)
        record["after_build"] = vm_hwm()
        if phases is not None:
            phases.mark("Trainer()")
            instrument_trainer_run(phases, trainer)
        trainer.fit()
        if phases is not None:
            phases.mark("fit done")
        rank, world = trainer.rank, trainer.world_size
        record["grid"] = str(trainer.grid.shape)
    elif mode == "steps":
        rank, world, device = init_distributed("gloo", timeout_s=300)
        spec = json.loads(os.environ["FOURFOLD_RANK_MEM_MODEL"])
        shape = GridShape(*spec["shape"])
        grid = Grid.build(shape, device)
        record["heap_peaks"] = [
            run_method_steps(ModelConfig(**case["model"]), grid, TrainConfig(**case["train"]),
                             case["batch"], steps=spec.get("steps", 2))
            for case in spec["cases"]]
        record["grid"] = str(shape)
    else:
        rank, world, device = init_distributed("gloo", timeout_s=300)
        spec = json.loads(os.environ["FOURFOLD_RANK_MEM_MODEL"])
        cfg = ModelConfig(**spec["model"])
        shape = GridShape(*spec["shape"])
        grid = Grid.build(shape, device)
        pcfg = ParallelConfig(x=shape.x, y=shape.y, z=shape.z, data=shape.data)
        if mode == "whole":
            pmodel = parallelize(build_model(cfg, seed=1), grid, pcfg)
        else:
            pmodel = parallelize(build_model(cfg, seed=1, device="meta"), grid, pcfg)
        record["after_build"] = vm_hwm()
        if mode == "build" and spec.get("export"):
            from fourfold.train.runs import save_weights_streamed

            save_weights_streamed(pmodel, Path(spec["export"]), cfg.tie_embeddings)
        record["grid"] = str(shape)
    record["peak"] = vm_hwm()
    if phases is not None:
        record["phases"] = phases.rows
    records = [record]
    if world > 1:
        records = [None] * world
        dist.all_gather_object(records, record)
    if rank == 0:
        with open(out_path, "w") as f:
            for r, rec in enumerate(records):
                f.write(json.dumps(dict(rec, rank=r)) + "\n")
    if world > 1:
        dist.barrier()
    leave_job(0)


def launch(nproc: int, mode: str, out: Path, env_extra: dict[str, str],
           timeout_s: float = 900) -> tuple[list[dict] | None, str]:
    """Run this worker on `nproc` ranks; (its JSON lines, or None if the launch failed, and
    the launch's stderr)."""
    from fourfold.train.host_memory import rank_malloc_environment

    # the malloc tuning `fourfold train --nproc` gives its CPU ranks (FOURFOLD_RANK_MEM_TUNABLES
    # = 0: without it, as under a launcher of the user's, with the in-process tuning only)
    tunables = rank_malloc_environment() if env_extra.get("FOURFOLD_RANK_MEM_TUNABLES",
                                                          "1") == "1" else {}
    env = dict(os.environ, FOURFOLD_RANK_MEM_MODE=mode, FOURFOLD_RANK_MEM_OUT=str(out),
               OMP_NUM_THREADS="1", **tunables, **env_extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if proc.returncode != 0 or not out.is_file():
        return None, proc.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stderr


if __name__ == "__main__":
    main()
