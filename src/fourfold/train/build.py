"""Building a training run from a Config: everything the loop needs, and the config resolved.

    cfg -> the model of an HF config.json (model.init_from) -> init_distributed -> device
        -> Grid (the planner's, with parallel.auto) -> tokenizer -> model -> parallelize
        -> HF weights -> compile -> optimizer -> data loaders, loss guard

The caller's Config is never changed: what the build decides (the planner's grid, the model of
an HF checkpoint) goes into a copy, Run.cfg, which is what the run records as its config.toml.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold.config import PRESETS, Config, ConfigError, validate
from fourfold.data import (BatchLoader, Tokenizer, check_data_path, load_tokenizer,
                           resolve_data_path)
from fourfold.data.tokenizers import tokenizer_fingerprint
from fourfold.models.adapter import apply_adapter
from fourfold.models.hf import HF_CONFIG_FILE, hf_model_config
from fourfold.models.llama import Llama, build_model
from fourfold.parallel import Grid, GridShape, ParallelModel, init_distributed, parallelize
from fourfold.plan.search import check_grid_fits, rank_memory_capacity
from fourfold.rundir import check_run_tokenizer, resolved_data_path
from fourfold.train.runs import CONFIG_FILE, run_config
from fourfold.train.checkpoint import list_checkpoints, verify_checkpoint
from fourfold.train.compile import BlockCompiler
from fourfold.train.host_memory import HostMemory
from fourfold.methods import method_spec
from fourfold.train.methods import TrainingMethod, batch_shard, build_method
from fourfold.train.resilience import LossGuard
from fourfold.train.trackers import require_trackers

# a vocabulary sized from the tokenizer is rounded up to this (even shards, aligned GEMMs)
VOCAB_MULTIPLE = 64


@dataclass
class Run:
    """The parts of one training run on this rank, as build_run made them."""

    cfg: Config  # resolved: a copy of the caller's config with the build's decisions in it
    run_dir: Path
    rank: int
    world_size: int
    device: torch.device
    grid: Grid
    data_dir: Path
    tokenizer: Tokenizer
    pmodel: ParallelModel
    compiler: BlockCompiler
    method: TrainingMethod  # train.optimizer's (train/methods)
    host: HostMemory  # what the run does about host memory (a no-op on a GPU)
    loader: BatchLoader  # whole steps; the trainer slices them into micro-batches
    val_loader: BatchLoader
    guard: LossGuard


def build_run(cfg: Config, run_dir: str | Path, *, model: Llama | None = None) -> Run:
    """Set up distribution, the device, the grid, data, model, optimizer and loaders for cfg.

    model: a fourfold Llama built elsewhere, whose config equals cfg.model (then
    model.init_from is not read). On a grid every rank calls this (it is collective). Raises
    ConfigError / GridError / DataError for user mistakes.
    """
    validate(cfg)
    # Before the ranks meet: a rank that raised after meeting would close its connections under
    # peers still making theirs, which then fail with gloo's traceback instead of this line.
    check_data_path(cfg.data.path)
    require_trackers(cfg)
    cfg = copy.deepcopy(cfg)  # the caller's config stays as it was
    t, p = cfg.train, cfg.parallel

    init_from = cfg.model.init_from if model is None else ""
    if init_from and (Path(init_from) / HF_CONFIG_FILE).is_file():
        # The architecture is the checkpoint's config.json (without one, cfg.model's); the
        # path stays in the config.
        cfg.model = dataclasses.replace(hf_model_config(init_from), init_from=init_from)
        if t.seq_len > cfg.model.max_seq_len:
            raise ConfigError(f"train.seq_len = {t.seq_len} is longer than the "
                              f"max_position_embeddings = {cfg.model.max_seq_len} of "
                              f"model.init_from = {init_from!r}; use at most "
                              f"{cfg.model.max_seq_len}")
    elif init_from and (Path(init_from) / CONFIG_FILE).is_file():
        # a fourfold RUN_DIR: its model, its weights (model.safetensors) to go on from
        cfg.model = dataclasses.replace(run_config(init_from).model, init_from=init_from)

    rank, world_size, dist_device = init_distributed(p.backend, p.timeout_s, device=t.device,
                                                     one_rank_group=p.engine == "always")
    device = _choose_device(t.device, dist_device, world_size)
    host = HostMemory.for_run(device, world_size, t.dtype)
    host.tune()
    if device.type == "cpu" and t.dtype == "bfloat16" and rank == 0 \
            and not cpu_has_bfloat16_gemm():
        warnings.warn("train.dtype = bfloat16 on a CPU without bfloat16 matrix instructions "
                      "(AVX-512 BF16/AMX): torch's bfloat16 GEMMs take a slow path here, "
                      "often 10-100x slower than float32; train.dtype = float32 is faster "
                      "on this CPU", stacklevel=2)
    if p.auto:
        planned = _planned_grid(cfg, world_size, rank)
        p = cfg.parallel = dataclasses.replace(p, x=planned.x, y=planned.y, z=planned.z,
                                               data=planned.data)
    shape = GridShape.resolve(p.x, p.y, p.z, p.data, world_size)
    grid = Grid.build(shape, device, timeout_s=p.timeout_s,
                      force_groups=p.engine == "always" and world_size == 1)
    # the axes the method splits its batch over: es gives every data replica the whole batch
    # (its population members split the data axis instead)
    spec = method_spec(t.optimizer)
    shard_index, shard_count = batch_shard(grid, spec.batch_axes)
    if t.batch_size % (t.grad_accum * shard_count):
        raise ConfigError(
            f"train.batch_size = {t.batch_size} does not split into train.grad_accum = "
            f"{t.grad_accum} micro-steps over {shard_count} batch shards "
            f"({'*'.join(spec.batch_axes)}); use a "
            f"multiple of {t.grad_accum * shard_count}")
    torch.manual_seed(t.seed)
    # one line naming the memory needed and a grid that fits, not an OOM halfway through; a
    # run that will resume loads a checkpoint, which imports the checkpoint library (a damaged
    # one, missing or truncated files, checked without hashing, it will skip)
    resumes = cfg.checkpoint.resume and any(
        verify_checkpoint(path, checksums=False) is None for path in list_checkpoints(run_dir))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    check_grid_fits(cfg, grid.shape, device.type == "cpu",
                    rank_memory_capacity(device, local_ranks), resumed=resumes)

    data_dir = resolve_data_path(cfg.data.path, cfg.data.tokenizer)
    tokenizer = load_tokenizer(data_dir)
    # the run records its tokenizer, and absolute paths: its config.toml works from anywhere
    fingerprint = tokenizer_fingerprint(tokenizer)
    check_run_tokenizer(cfg, data_dir, fingerprint)
    cfg.data = dataclasses.replace(cfg.data, path=resolved_data_path(cfg.data.path),
                                   tokenizer_fingerprint=fingerprint)
    if init_from and not init_from.startswith("builtin:"):
        cfg.model.init_from = str(Path(init_from).expanduser().resolve())
    if cfg.model.vocab_size < tokenizer.vocab_size and init_from:
        raise ConfigError(
            f"the tokenizer of data.path = {cfg.data.path!r} has {tokenizer.vocab_size} tokens, "
            f"more than the {cfg.model.vocab_size} of model.init_from = {init_from!r}: it is "
            "not the model's tokenizer; prepare the data with the model's tokenizer")
    if (cfg.model.vocab_size < tokenizer.vocab_size and model is None
            and cfg.model.vocab_size == PRESETS.get(cfg.model.preset, {}).get("vocab_size")):
        # the preset's vocabulary, too small for the data: the tokenizer's size instead
        vocab = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        if rank == 0:
            print(f"model.vocab_size = {vocab}: the tokenizer's {tokenizer.vocab_size} tokens "
                  f"(rounded up to a multiple of {VOCAB_MULTIPLE}), more than model.preset = "
                  f"{cfg.model.preset!r}'s {cfg.model.vocab_size}", file=sys.stderr, flush=True)
        cfg.model = dataclasses.replace(cfg.model, vocab_size=vocab)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens ({data_dir}); set model.vocab_size to at least "
            f"{tokenizer.vocab_size}")

    if model is not None and model.cfg != cfg.model:
        raise ConfigError("the model passed to Trainer does not match cfg.model; build it "
                          "with build_model(cfg.model)")
    if model is not None:
        model.to(device)
    pmodel, compiler, method = build_model_parts(cfg, grid, host, model, init_from)

    # The loader hands out whole steps; micro-batches are slices of them, so the data a step
    # sees does not depend on grad_accum. Validation batches are whole steps too (evaluated in
    # micro-batch slices), so the validation set depends neither on grad_accum nor on the grid.
    # Packed rows are spread over the shards and micro-batches by the planner's cost of their
    # attention against their GEMMs (on a GPU of the catalog; by their FLOPs elsewhere).
    from fourfold.plan.machine_file import machine_for_torch_device
    from fourfold.plan.perf import sequence_cost

    cost = sequence_cost(cfg.model, t.seq_len, machine_for_torch_device(device)
                         if device.type == "cuda" else None, t.dtype)
    loader = BatchLoader(data_dir, "train", t.batch_size, t.seq_len, t.seed,
                         shard_index=shard_index, num_shards=shard_count,
                         packing=cfg.data.packing, micro_batches=t.grad_accum, cost=cost)
    val_loader = BatchLoader(data_dir, "val", t.batch_size, t.seq_len, t.seed,
                             shard_index=shard_index, num_shards=shard_count,
                             packing=cfg.data.packing, micro_batches=t.grad_accum, cost=cost)
    return Run(cfg=cfg, run_dir=Path(run_dir), rank=rank, world_size=world_size, device=device,
               grid=grid, data_dir=data_dir, tokenizer=tokenizer, pmodel=pmodel,
               compiler=compiler, method=method, host=host, loader=loader,
               val_loader=val_loader,
               guard=LossGuard(t.spike_threshold))


def build_model_parts(cfg: Config, grid: Grid, host: HostMemory, model: Llama | None = None,
                      init_from: str = "") -> tuple[ParallelModel, BlockCompiler, TrainingMethod]:
    """This rank's parallel model (its shards of cfg.model, or of `model`), the block compiler
    and cfg.train's training method; HF weights from `init_from`."""
    t = cfg.train
    if model is None:  # on the meta device: parallelize builds only this rank's shards
        model = build_model(cfg.model, seed=t.seed, device="meta")
    # Set before parallelize, which converts the layers in place and keeps the flag.
    model.activation_checkpointing = t.activation_checkpointing
    pmodel = parallelize(model, grid, cfg.parallel,
                         blocked_loss=method_spec(t.optimizer).blocked_loss,
                         grad_buffers=host.grad_buffers())
    if init_from:
        from fourfold.models.hf import load_hf_into

        load_hf_into(pmodel, init_from)  # each rank reads just its own shards
    # Freeze the base and add LoRA factors, or free the norm gains: before compile and the
    # optimizer, which then see only the adapter as trainable.
    apply_adapter(pmodel, cfg.adapter, t.seed)
    compiler = BlockCompiler(pmodel.module, t.compile)
    method = build_method(pmodel, t, tied_output=cfg.model.tie_embeddings, hooks=host.hooks())
    return pmodel, compiler, method


def _choose_device(requested: str, dist_device: torch.device, world_size: int) -> torch.device:
    if world_size > 1:
        return dist_device  # init_distributed picked it with the backend
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device = \"cuda\" but no CUDA device is available; use "
                              "\"cpu\" or \"auto\"")
        return torch.device("cuda")
    return torch.device("cpu")


def _planned_grid(cfg: Config, world_size: int, rank: int) -> GridShape:
    """parallel.auto: rank 0 asks the planner for the fastest grid that fits and tells the
    others (each rank's own CPU probe could differ, and all ranks must build the same grid)."""
    choice: list[object] = [None]
    if rank == 0:
        from fourfold.plan import choose_grid  # the planner never imports the trainer
        from fourfold.plan.perf import Overlap

        t, p = cfg.train, cfg.parallel
        overlap = Overlap(overlap_input_grad=p.overlap_input_grad,
                          overlap_weight_grad=p.overlap_weight_grad,
                          prefetch_weights=p.prefetch_weights,
                          overlap_data_grad=p.overlap_data_grad,
                          overlap_forward=p.overlap_forward)
        shape, why = choose_grid(cfg.model, world_size, p.machine, t.batch_size,
                                 t.seq_len, dtype=t.dtype, overlap=overlap,
                                 activation_checkpointing=t.activation_checkpointing,
                                 grad_accum=t.grad_accum, reduce_dtype=p.reduce_dtype,
                                 train=t)  # the grid must fit train.optimizer's memory
        print(f"parallel.auto: {why}", file=sys.stderr, flush=True)  # why names the grid
        choice[0] = (shape.data, shape.z, shape.y, shape.x)
    if world_size > 1:
        dist.broadcast_object_list(choice, src=0)
    data, z, y, x = choice[0]  # type: ignore[misc]
    return GridShape(data=data, z=z, y=y, x=x)


__all__ = ["Run", "build_model_parts", "build_run"]


def cpu_has_bfloat16_gemm() -> bool:
    """Whether torch's CPU GEMMs run bfloat16 natively here (oneDNN with AVX-512 BF16 or AMX);
    without, they fall back to a generic loop that is far slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True  # a torch that cannot say: no warning

