"""Memory per rank of a 4D configuration: parameters, gradients, AdamW states, activations
(with and without activation checkpointing), gathered-weight buffers, the data-parallel
gradient buckets, the transients of building the model in shards and of exporting it, an
asynchronous checkpoint's snapshot, and (on a host) the runtime's own growth. A training
method's own gradients, state and update transient come from its planner model
(plan/methods, `predict_method_memory`).

`predict_memory` is the rank model, one MemoryBreakdown; what each term models, and what
checks it:
- params, grads, optimizer: local_param_numel x bytes (tests/test_parallel.py, against the
  built model);
- activations, logits: autograd's saved tensors and the loss's workspace
  (tests/test_memory_model.py);
- block_transient: one block's temporaries beyond what it saves (its backward's at the
  SwiGLU's gradient; a forward-only method's no-grad forward); the logits are gone before any
  block's backward, so a step counts the larger of the two (MemoryBreakdown.step;
  tests/test_lean_heap.py holds the total against the heap in use at every op of a step);
- loss_grads: the gradients alive at the loss, none unless micro-steps accumulate them
  (every method frees or hands off its gradients within a step);
- head_activations, last_block_activations, first_block_grads: the ends of backward, between
  which the saved activations go while the gradients come (MemoryBreakdown.step): at the first
  block's backward every activation but the final norm's and the output layer's with only the
  gradients made so far, at the last block's one block's activations with every gradient.
  fourfold.simulate runs the real code of a rank at full scale and counts its live tensors;
  tests/test_simulate_scale.py holds every term but `runtime` (the tensors) within 3% of
  that peak for `70b` on 1,024 ranks and `405b` on 16,384;
- gathered_weights: the z all-gather buffers (current + prefetched) and one dW block;
- comm_buffers: what the data all-reduce holds beyond the gradients, which are views of
  their buckets' buffers (parallel/data_parallel.py): a lower reduce_dtype's casts;
- startup: one init tile (on a host); export: one block, and the export writer's full tensor
  (on a host);
- checkpoint: an asynchronous snapshot (params and AdamW states copied to host memory), alive
  through the next step, where it shares the rank's memory (a CPU rank);
- runtime (on a host): what a rank touches beyond a process that imported fourfold, not as
  tensors (library code and data first used by a step, gloo's and the checkpoint writer's
  threads, the interpreter's objects, under bfloat16 oneDNN's primitive cache): a constant
  per rank, less without a backward, plus the libraries a run imports (`library_bytes`:
  torch._dynamo, the checkpoint library).
bench/memory.py (--phases: VmRSS, VmHWM and the heap in use at each phase of a run),
bench/memory_lean.py and bench/train_memory.py compare the total with what ranks hold; their
current figures are in docs/results.md. On a host the allocator is tuned to reuse freed blocks
(train/host_memory.py), so that a rank's resident memory follows the heap in use.

What a rank holds that the model leaves out, and why:
- the runtime's import itself (Python, torch's libraries, on a GPU the CUDA context): the
  search takes `reserved_gib` per rank off for it (`Machine.usable_memory_bytes`);
- the token shards, which are memory-mapped, and unmapped after each batch's reads (they stay
  in the page cache, outside the process's resident memory: data/loader.py);
- the optimizer step's and the gradient norm's temporaries (a few tensors of one layer's size);
- on a GPU, the caching allocator's slack (its fragmentation is not modelled);
- on a CPU rank of a grid, the heap pages that a step's blocks wander onto beyond the heap in
  use (where glibc places them depends on when gloo's threads free theirs).

The search compares the total with `Machine.usable_memory_bytes`, which divides a memory shared
by several ranks (a host's) among them and takes `reserved_gib` per rank off for the runtime.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fourfold.config import Config, ModelConfig, ParallelConfig
from fourfold.parallel.data_parallel import in_flight_wire_bytes
from fourfold.parallel.embedding import (NO_GRAD_LOSS_BLOCK_ELEMENTS, output_loss_columns,
                                         resolve_output_loss, uses_blocked_loss)
from fourfold.parallel.grid import GridShape
from fourfold.methods import method_spec
from fourfold.plan.errors import PlanError
from fourfold.plan.methods.base import method_model
from fourfold.plan.schedule import block_linears, local_param_numel

if TYPE_CHECKING:
    from fourfold.config import TrainConfig



@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor.

    float32: everything in fp32. bfloat16: autocast, as the engine runs it: fp32 parameters,
    gradients and AdamW states; the z all-gather moves bf16 weights (weight_bytes 2: the shard
    is cast before the gather); GEMM outputs and input gradients are bf16 (act_bytes 2) while
    the residual stream (embedding and norm outputs) stays fp32 (residual_bytes 4). Gradient
    reductions travel in parallel.reduce_dtype (reduce_bytes).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # AdamW: two fp32 states per parameter
    weight_bytes: int  # gathered weights (all-gather over z)
    act_bytes: int  # GEMM outputs
    residual_bytes: int  # the residual stream
    reduce_bytes: int = 4  # gradients on the wire (z reduce-scatter, data all-reduce)

    @classmethod
    def of(cls, dtype: str, reduce_dtype: str = "float32") -> "Precision":
        if reduce_dtype not in ("float32", "bfloat16"):
            raise PlanError(f"reduce_dtype = {reduce_dtype!r}: choose float32 or bfloat16")
        reduce_bytes = 4 if reduce_dtype == "float32" else 2
        if dtype == "float32":
            return cls("float32", 4, 4, 8, 4, 4, 4, reduce_bytes)
        if dtype == "bfloat16":
            return cls("bfloat16", 4, 4, 8, 2, 2, 4, reduce_bytes)
        raise PlanError(f"dtype = {dtype!r}: choose float32 or bfloat16")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the peak of a step."""

    params: int
    grads: int
    optimizer: int
    activations: int
    gathered_weights: int  # prefetched z all-gather buffers and the full dW before its scatter
    logits: int  # output-layer logits and the loss's fp32 workspace
    comm_buffers: int = 0  # the data all-reduce's wire-dtype casts of its buckets in flight
    startup: int = 0  # building in shards: one block of the largest tensor and one init tile
    export: int = 0  # streaming the model out: the writer's full tensor (host), a block
    checkpoint: int = 0  # an asynchronous checkpoint's snapshot, when it shares this memory
    runtime: int = 0  # on a host: pages a run touches beyond the import, other than tensors
    update: int = 0  # a method's update temporaries after backward (its activations are freed)
    recompute: int = 0  # of `activations`: one checkpointed block's, alive during its backward
    block_transient: int = 0  # one block's temporaries beyond what it saves (see step)
    loss_grads: int = 0  # of `grads`: those alive at the loss (see step)
    cast_weights: int = 0  # weights' compute-dtype copies autocast keeps to the loss (see step)
    loss_forward: int = 0  # of `logits`: what the loss's forward holds (see step)
    tokens: int = 0  # a micro-step's tokens on this rank, which the transients are sized for
    # of `activations`: the final norm's and the output layer's, freed before any block's
    # backward (see step)
    head_activations: int = 0
    # of `activations`: those still saved at the backward of the first layer, the last block to
    # run (its own saved tensors, or its checkpointed input, and the embedding's)
    last_block_activations: int = 0
    # of `grads`: the most that exist at the backward of the last layer, the first block to
    # run (the output layer's, the final norm's and that block's; see step)
    first_block_grads: int = 0

    @property
    def step(self) -> int:
        """The peak of a training step beyond the parameters and optimizer state: the largest
        of the loss, the first block's backward and the last block's, which are never alive
        together.

        The loss (the end of the forward) holds every saved activation, the logits,
        `cast_weights` (under autocast on one process) and `loss_grads`: no gradient with
        grad_accum = 1 (every method frees or hands off its gradients within a step; AdamW
        sets them to None before the forward), all of them on the micro-steps after the first
        with grad_accum > 1. Autocast lets its copies go as the forward ends, the loss's
        forward included: they meet only `loss_forward` of the loss, where that is less than
        `logits` (the blocked loss, whose backward makes the output layer's dW and casts its
        weight anew).

        Then the blocks' backward runs from the last layer to the first: each frees what its
        block saved (or its checkpointed input, after its recomputed activations) while its
        gradients arrive, so what is alive moves in a straight line from the first block's
        backward to the last one's, and its largest is at one end or the other. The first
        block's backward holds every saved activation but the output layer's and the final
        norm's (`head_activations`, freed by their backward before it), its recomputed
        activations and its temporaries (`block_transient`), and of the gradients only those
        that exist by then (`first_block_grads`). The last block's backward holds what that
        block and the embedding saved (`last_block_activations`), its recompute and
        temporaries, and `grads`, the most gradient bytes the method holds at once (all of
        them under AdamW).

        Without a backward (mezo, es) `block_transient` is a block's no-grad forward, with
        (under autocast on one process) every block linear's cached compute-dtype copy, which
        the cache gathers through the forward."""
        alive = self.gathered_weights + self.comm_buffers + self.checkpoint
        loss = max(self.cast_weights + (self.loss_forward or self.logits), self.logits)
        at_loss = self.activations - self.recompute + self.loss_grads + loss
        first_block = (self.activations - self.head_activations + self.block_transient
                       + max(self.loss_grads, min(self.grads, self.first_block_grads)))
        last_block = (self.last_block_activations + self.recompute + self.block_transient
                      + self.grads)
        return alive + max(at_loss, first_block, last_block)

    @property
    def total(self) -> int:
        """Peak bytes: the parameters and optimizer state plus the largest of the step, the
        update after backward (with every gradient), the build and the export (which run one
        after the other)."""
        return (self.params + self.optimizer + self.runtime
                + max(self.step, self.grads + self.update, self.startup, self.export))


def predict_param_memory(model_cfg: ModelConfig, shape: GridShape,
                         precision: Precision | None = None) -> dict[str, int]:
    """Bytes per rank of parameters, gradients and AdamW states (float32 unless told)."""
    p = precision or Precision.of("float32")
    numel = sum(local_param_numel(model_cfg, shape).values())
    return {"params": numel * p.param_bytes, "grads": numel * p.grad_bytes,
            "optimizer": numel * p.optimizer_bytes}


def autocast_on_torch_layers(shape: GridShape, precision: Precision) -> bool:
    """Whether the rank runs torch's own layers under autocast: one process (parallelize leaves
    a one-rank model as it is; on grids Linear3D casts its own weights and inputs) below
    float32. Autocast then casts a weight once and caches the copy, and casts a GEMM's input
    anew for every GEMM that reads it."""
    return shape.size == 1 and precision.act_bytes < precision.residual_bytes


def autocast_weight_copies(model: ModelConfig, precision: Precision, output_loss: str,
                           down: bool) -> tuple[int, int]:
    """Bytes of the compute-dtype weight copies autocast caches on torch's own layers (see
    autocast_on_torch_layers): (every block linear's, the output layer's). The down
    projections only with `down` (with a backward models/llama.py's down projection casts its
    own weight); the output layer's only with whole logits (the blocked loss casts its own)."""
    blocks = sum(lin.out_features * lin.in_features for lin in block_linears(model)
                 if down or lin.name != "down") * model.n_layers
    output = 0 if uses_blocked_loss(output_loss) else model.vocab_size * model.dim
    return blocks * precision.act_bytes, output * precision.act_bytes


def activation_bytes_per_token(model: ModelConfig, shape: GridShape,
                               precision: Precision) -> dict[str, int]:
    """Per token on a rank: what one block keeps for backward (`block`), the block input a
    checkpointed block keeps instead (`checkpoint`), and what the embedding and the final norm
    keep (`outside`: the final norm's and the output layer's, `head`, and the embedding's,
    `embedding`). Measured against autograd's saved tensors in tests/test_memory_model.py.

    Attention assumes a fused SDPA kernel (flash / memory-efficient, as on CPU and CUDA for a
    causal mask): it keeps q, k, v and its output, which it lays out so that the o projection's
    input is a view of it, plus an fp32 log-sum-exp per head; no T x T scores."""
    gx, gy = shape.x, shape.y
    d, f = model.dim, model.ffn_dim
    heads_dim = model.n_heads * model.head_dim
    # per norm: its input (with a per-token rstd: parallel/norm.py recomputes the normalized
    # tensor in backward) in the residual stream's dtype, and its output, which the next GEMMs
    # keep in the compute dtype (Linear3D keeps the cast it multiplies, once for q/k/v and once
    # for gate/up; the float32 output goes)
    norm_inputs, norm_outputs = 2 * d // gx, 2 * d // gx
    act, residual = precision.act_bytes, precision.residual_bytes
    # under autocast on torch's own layers each GEMM keeps its own compute-dtype cast of the
    # norm's output (q, k and v three, gate and up two), and the float32 output goes: 2 d bytes
    # a token a block more than one float32 output a norm (tests/test_memory_model.py)
    if autocast_on_torch_layers(shape, precision):
        norm_outputs = 5 * d
    # k and v are saved after the GQA repeat, so they are as wide as q
    attention = 4 * heads_dim // gy
    # gate out and up out: models/llama.py's swiglu recomputes silu, and down recomputes its
    # input silu(gate) * up from them (Linear3D's `recompute`)
    mlp = 2 * f // gy
    stats = 4 * (2 + model.n_heads // gy)  # an fp32 rstd per norm, an fp32 lse per local head
    # final norm: its input, its output (kept by the output layer or the blocked loss in the
    # compute dtype) and its rstd; token ids (int64) and the embedding's ownership mask (bool)
    head, embedding = d // gx * (residual + act) + 4, 9
    return {"block": norm_inputs * residual + (norm_outputs + attention + mlp) * act + stats,
            "checkpoint": d // gx * residual, "outside": head + embedding, "head": head,
            "embedding": embedding}


def block_transient_bytes_per_token(model: ModelConfig, shape: GridShape, precision: Precision,
                                    backward: bool = True) -> int:
    """Per token on a rank: the most a block holds at once beyond what it saved for backward,
    at its feed-forward part (wider than attention's: ffn_dim against the heads).

    backward: at the SwiGLU's gradient (models/llama.py: dy, d_up, the bracket and dy * up
    beside gate and up), three ffn-wide tensors on top of the recompute's saved ones, a figure
    fitted to measurement. Without a backward (mezo, es): the block's input, the residual after
    attention and the normalized input, with gate, up, silu(gate) and their product. Checked by
    tests/test_lean_heap.py (the heap in use after every op of a step) and, on a GPU, by
    bench/memory_lean.py --device cuda."""
    d, f = model.dim // shape.x, model.ffn_dim // shape.y
    if backward:
        return 3 * f * precision.act_bytes
    return 3 * d * precision.residual_bytes + 4 * f * precision.act_bytes


# The runtime term (see the module docstring), per host rank: with a backward, and without
# one (MeZO, ES); bench/memory_lean.py --cli reads both beside `fourfold train`'s ranks
HOST_RUNTIME_BYTES = 40 * 2**20
HOST_FORWARD_ONLY_RUNTIME_BYTES = 27 * 2**20
# torch._dynamo, which torch.optim (AdamW) and train.compile import at their first use, and a
# grid's checkpoint (loads_dynamo); nothing else in a run does (models/recompute.py, meta
# builds): resident bytes above `import fourfold`
TORCH_DYNAMO_BYTES = 70 * 2**20
# torch.distributed.checkpoint (with DTensor, sympy and torch.fx), imported at a run's first
# checkpoint; far less where torch._dynamo is in already (they share sympy and torch.fx)
CHECKPOINT_LIBRARY_BYTES = 45 * 2**20
CHECKPOINT_LIBRARY_AFTER_DYNAMO_BYTES = 2 * 2**20


def library_bytes(dynamo: bool, checkpoints: bool) -> int:
    """Resident bytes of the libraries a host run imports beyond `import fourfold`:
    torch._dynamo (`dynamo`: AdamW's torch.optim, train.compile, a checkpoint's DTensors on a
    grid) and the checkpoint library (`checkpoints`: the run writes or loads them)."""
    if not checkpoints:
        return TORCH_DYNAMO_BYTES if dynamo else 0
    if dynamo:
        return TORCH_DYNAMO_BYTES + CHECKPOINT_LIBRARY_AFTER_DYNAMO_BYTES
    return CHECKPOINT_LIBRARY_BYTES


def loads_dynamo(train: "TrainConfig", shape: GridShape, checkpoints: bool) -> bool:
    """Whether a run imports torch._dynamo: its method (AdamW's torch.optim), train.compile,
    or a grid's checkpoint (DTensor.from_local); nothing else in a run does
    (models/recompute.py, build_model on the meta device)."""
    return (method_model(train.optimizer).imports_dynamo or train.compile
            or (checkpoints and shape.size > 1))


INIT_TILE_BYTES = 1024 * 1024 * 4  # fourfold.models.init: one float32 tile drawn at a time


def largest_tensor_numel(model: ModelConfig, shape: GridShape) -> tuple[int, int]:
    """(elements of the largest full weight, of its largest block on a rank of `shape`)."""
    tensors = [(lin.out_features * lin.in_features, shape.x * shape.y * shape.z)
               for lin in block_linears(model)]
    tensors.append((model.vocab_size * model.dim, shape.x * shape.y * shape.z))
    full = max(n for n, _ in tensors)
    return full, max(n // parts for n, parts in tensors)


def logits_bytes(model: ModelConfig, shape: GridShape, tokens: int, precision: Precision,
                 output_loss: str = "auto", backward: bool = True) -> int:
    """The output layer's and the loss's transients (parallel/embedding.py; `output_loss` as
    the run resolves it, embedding.resolve_output_loss: "auto" here is AdamW's).

    Whole logits: the loss's forward holds the logits (this rank's vocabulary slice) in the
    compute dtype, below float32 also their float32 copy, and the exponentials it makes in
    float32.
    The blocked loss: one block of columns of them in float32 (below float32 also its two
    copies in the compute dtype), plus two floats a token kept for backward; with a
    `backward`, the output layer's backward also holds its weight gradient (float32), and
    below float32 the weight's compute-dtype copy and, on a grid, the gradient made in that
    dtype, cast to float32 after the block loop (on one process it is made in float32 block by
    block)."""
    width = model.vocab_size // shape.y
    act = precision.act_bytes
    if not uses_blocked_loss(output_loss):
        return tokens * width * (act + 4 + (4 if act < 4 else 0))
    columns = min(width, output_loss_columns(tokens))
    out = tokens * columns * (4 + (2 * act if act < 4 else 0)) + 8 * tokens
    if backward:
        block = model.vocab_size * model.dim // (shape.x * shape.y)
        if act < 4 and shape.size > 1:
            # dW made in the compute dtype beside the weight's copy through the block loop, its
            # float32 gradient after it, when the blocks' transients are gone: the peak is in
            # the loop
            return max(out, block * precision.grad_bytes + 8 * tokens) + block * 2 * act
        out += block * (precision.grad_bytes + (act if act < 4 else 0))
    return out


def predict_memory(model: ModelConfig, shape: GridShape, micro_batch_tokens: int,
                   activation_checkpointing: bool, precision: Precision, *,
                   bucket_bytes: int = ParallelConfig().bucket_bytes, on_host: bool = False,
                   writer: bool = False, async_checkpoint: bool = False,
                   checkpoints: bool = False, output_loss: str = "auto",
                   grad_accum: int = 1) -> MemoryBreakdown:
    """Peak bytes per rank: of one training step, of building the model in shards, and of
    streaming it out at the end, whichever is largest, on top of the model state.

    `on_host`: the rank computes in host memory (a CPU run), so that the host-side parts count:
    the export writer's (`writer`) full copy of each tensor in turn, and the snapshot an
    asynchronous checkpoint copies the shards into while training goes on, and the runtime's
    own growth (HOST_RUNTIME_BYTES, and AdamW's import of torch._dynamo: predict_method_memory
    takes it off for the other methods where they never load it), with the checkpoint
    library's import where the run writes or loads checkpoints (`checkpoints`). `output_loss`:
    parallel.output_loss as the run resolves it (the logits whole, or a block of the
    vocabulary at a time). `grad_accum`: micro-steps per step (above 1 the gradients live
    through the later micro-steps' losses). Each term and the measurement it rests on: see
    the module docstring."""
    gx, gy = shape.x, shape.y
    states = predict_param_memory(model, shape, precision)
    n = micro_batch_tokens
    per_token = activation_bytes_per_token(model, shape, precision)
    recompute = n * per_token["block"] if activation_checkpointing else 0
    if activation_checkpointing:
        # every block keeps its input; one block at a time is recomputed with full activations
        activations = n * model.n_layers * per_token["checkpoint"] + recompute
    else:
        activations = n * model.n_layers * per_token["block"]
    activations += n * per_token["outside"]
    head_activations = n * per_token["head"]
    # the first layer's backward runs last: its checkpointed input (and recomputed activations,
    # `recompute`) or what it saved, and the embedding's
    last_block_activations = n * (per_token["checkpoint" if activation_checkpointing else "block"]
                                  + per_token["embedding"])
    layer_block = sum(lin.out_features * lin.in_features for lin in block_linears(model))
    layer_block //= gx * gy
    vocab_block = model.vocab_size * model.dim // (gx * gy)
    # the current and the prefetched next layer's weights, plus one full dW before its scatter;
    # this also bounds what the engine keeps: a checkpointed block's recomputed weights (one
    # block) through its backward, and the output layer's block from its forward to its
    # backward (only when no larger than the `logits` term: engine.keeps_output_block)
    gathered = max(2 * layer_block * precision.weight_bytes + layer_block * precision.grad_bytes,
                   vocab_block * (precision.weight_bytes + precision.grad_bytes))
    if shape.z == 1:
        gathered = layer_block * precision.grad_bytes  # no gather buffers; still dW per layer
    logits = logits_bytes(model, shape, n, precision, output_loss)
    loss_forward = 0  # whole logits: the loss's forward holds what its backward does
    if uses_blocked_loss(output_loss):  # its blocks, and below float32 the weight's copy
        loss_forward = (logits_bytes(model, shape, n, precision, output_loss, backward=False)
                        + (vocab_block * precision.act_bytes if precision.act_bytes < 4 else 0))
    # under autocast on torch's own layers autocast caches each weight's compute-dtype copy
    # from its first GEMM to the end of the forward, the loss included: those of every linear
    # that autocast runs (models/llama.py's down projection casts its own) and the whole
    # output layer's. Without activation checkpointing each layer also saves its copy for
    # backward, until its own backward: saved activations then
    # (the output layer's until its backward, each block's until its own)
    cast_weights = 0
    if autocast_on_torch_layers(shape, precision):
        blocks_cast, output_cast = autocast_weight_copies(model, precision, output_loss,
                                                          down=False)
        if activation_checkpointing:
            cast_weights = blocks_cast + output_cast
        else:
            activations += blocks_cast + output_cast
            head_activations += output_cast
            last_block_activations += blocks_cast // model.n_layers
    # the gradients that exist at the last layer's backward, the first block's to run: the
    # output layer's, the final norm's and that block's own; with data > 1 also the rest of
    # the buffer of the bucket being filled, made at its first gradient for all of its
    # gradients (parallel/data_parallel.py)
    vocab_numel, norm_numel = vocab_block // shape.z, model.dim // gx
    layer_numel = (sum(local_param_numel(model, shape).values()) - norm_numel
                   - vocab_numel * (1 if model.tie_embeddings else 2)) // model.n_layers
    first_block_grads = ((vocab_numel + norm_numel + layer_numel) * precision.grad_bytes
                         + (bucket_bytes if shape.data > 1 else 0))
    # the gradients are views of their buckets' buffers, all-reduced in place: beyond them only
    # a lower reduce_dtype's casts of the buckets in flight
    comm_buffers = (in_flight_wire_bytes(bucket_bytes, precision.grad_bytes,
                                         precision.reduce_bytes) if shape.data > 1 else 0)
    full_numel, block_numel = largest_tensor_numel(model, shape)
    # parallel/shards.py materialize: each block is drawn on the host a tile at a time into
    # the float32 tensor that becomes the parameter (on a GPU it is moved there: the device
    # holds it once, as the parameter), so beyond the weights only the tile is alive, on the
    # host (bench/memory_lean.py --phases reads the build's peak)
    startup = INIT_TILE_BYTES if on_host else 0
    export = block_numel * precision.param_bytes  # the receive (or send) buffer of one block
    if on_host and writer:
        export += full_numel * precision.param_bytes
    checkpoint = (states["params"] + states["optimizer"]
                  if on_host and async_checkpoint else 0)
    return MemoryBreakdown(params=states["params"], grads=states["grads"],
                           optimizer=states["optimizer"], activations=activations,
                           gathered_weights=gathered, logits=logits, comm_buffers=comm_buffers,
                           startup=startup, export=export, checkpoint=checkpoint,
                           runtime=(HOST_RUNTIME_BYTES + library_bytes(True, checkpoints)
                                    if on_host else 0),
                           recompute=recompute,
                           loss_grads=states["grads"] if grad_accum > 1 else 0, tokens=n,
                           cast_weights=cast_weights, loss_forward=loss_forward,
                           head_activations=head_activations,
                           last_block_activations=last_block_activations,
                           first_block_grads=first_block_grads,
                           block_transient=n * block_transient_bytes_per_token(model, shape,
                                                                               precision))


# ---- per training method (train.optimizer): kept apart from the rank model above ---------------


def matrix_layouts(model: ModelConfig
                   ) -> list[tuple[int, int, tuple[str, ...], tuple[str, ...]]]:
    """(full rows, full cols, the axes that split the rows, those that split the columns) of
    every weight matrix, as the engine lays them out: W[out, in] with out split over (y, z)
    and in over x (a transposed layer swaps x and y); the embedding and output layer as a
    normal layer."""
    out = []
    for lin in block_linears(model):
        rows, cols = (("x", "z"), ("y",)) if lin.transposed else (("y", "z"), ("x",))
        out += [(lin.out_features, lin.in_features, rows, cols)] * model.n_layers
    return out + [(model.vocab_size, model.dim, ("y", "z"), ("x",))] * (
        1 if model.tie_embeddings else 2)


def axes_parts(axes: tuple[str, ...], shape: GridShape) -> int:
    """How many parts `axes` split a dimension into on `shape`."""
    return math.prod(getattr(shape, a) for a in axes)


def local_matrices(model: ModelConfig, shape: GridShape) -> list[tuple[int, int, int, int]]:
    """(full rows, full cols, local rows, local cols) of every weight matrix on a rank
    (`matrix_layouts`)."""
    return [(m, n, m // axes_parts(rows, shape), n // axes_parts(cols, shape))
            for m, n, rows, cols in matrix_layouts(model)]


def local_vector_numel(model: ModelConfig, shape: GridShape) -> int:
    """Elements of a rank's vector parameters (norm gains, biases): all but the matrices."""
    numel = sum(local_param_numel(model, shape).values())
    return numel - sum(rl * cl for _, _, rl, cl in local_matrices(model, shape))


def vector_layouts(model: ModelConfig) -> list[tuple[str, ...]]:
    """The axes that split each vector parameter: norm weights over x, a bias where its
    layer's output lives."""
    out = [("x",)] * (2 * model.n_layers + 1)
    if model.bias:
        for lin in block_linears(model):
            out += [("x",) if lin.transposed else ("y",)] * model.n_layers
    return out


def predicted_memory(cfg: Config, shape: GridShape, on_host: bool,
                     resumed: bool = False) -> MemoryBreakdown:
    """The peak bytes per rank of cfg's run on `shape`, under its training method
    (predict_memory with predict_method_memory), as build_run's fits check and
    train.memory_report take it. `on_host`: a CPU run; `resumed`: the run loads a checkpoint,
    which imports the checkpoint library as writing one does."""
    t, p = cfg.train, cfg.parallel
    precision = Precision.of(t.dtype)
    spec = method_spec(t.optimizer)
    micro_tokens = t.batch_size // spec.batch_shards(shape) // t.grad_accum * t.seq_len
    output_loss = resolve_output_loss(p.output_loss, spec.blocked_loss)
    writes = cfg.checkpoint.every > 0
    checkpoints = writes or resumed  # the checkpoint library is in
    mem = predict_memory(cfg.model, shape, micro_tokens, t.activation_checkpointing, precision,
                         bucket_bytes=p.bucket_bytes, on_host=on_host, writer=True,
                         async_checkpoint=cfg.checkpoint.is_async(on_host) and writes,
                         checkpoints=checkpoints, output_loss=output_loss,
                         grad_accum=t.grad_accum)
    return predict_method_memory(mem, cfg.model, shape, t, precision, output_loss, checkpoints)


def predict_method_memory(breakdown: MemoryBreakdown, model: ModelConfig, shape: GridShape,
                          train: "TrainConfig", precision: Precision | None = None,
                          output_loss: str = "auto", checkpoints: bool = False
                          ) -> MemoryBreakdown:
    """`breakdown` (predict_memory's, which counts AdamW) with train.optimizer's gradients, state
    and update transient (its planner model, plan/methods); a forward-only method (mezo, es)
    has no saved activations, no dW or gradient buckets.
    `output_loss`, `checkpoints`: as predict_memory had them (on a host the runtime counts the
    libraries this run imports: library_bytes).

    bench/memory_lean.py (--phases: the heap in use at each method's peak) holds these terms
    against the live tensors at each peak."""
    p = precision or Precision.of("float32")
    model_of_method = method_model(train.optimizer)
    forward_only = method_spec(train.optimizer).forward_only
    state = model_of_method.state(model, shape, train, p)
    out = dataclasses.replace(breakdown, grads=state.grads, optimizer=state.optimizer,
                              loss_grads=state.grads if train.grad_accum > 1 else 0,
                              update=model_of_method.update_bytes(model, shape, train))
    if out.runtime:  # predict_memory counted AdamW's libraries
        own = HOST_FORWARD_ONLY_RUNTIME_BYTES if forward_only else HOST_RUNTIME_BYTES
        out = dataclasses.replace(out, runtime=own + library_bytes(
            loads_dynamo(train, shape, checkpoints), checkpoints))
    if forward_only:
        layer_block = sum(lin.out_features * lin.in_features for lin in block_linears(model))
        layer_block //= shape.x * shape.y
        gathered = 2 * layer_block * p.weight_bytes if shape.z > 1 else 0
        # a no-grad forward's peak is its loss or one block's forward, whichever is larger
        # (MemoryBreakdown.step). The loss: the logits (and their float32 copy when they are
        # not float32) and one block of rows of the loss's temporaries (parallel/embedding.py
        # works a loss without backward block by block)
        if not uses_blocked_loss(output_loss):
            numel = breakdown.tokens * (model.vocab_size // shape.y)
            logits = (numel * (p.act_bytes + (4 if p.act_bytes < 4 else 0))
                      + 4 * min(numel, NO_GRAD_LOSS_BLOCK_ELEMENTS))  # parallel/embedding.py
        else:  # the blocked loss: one block of the vocabulary, as with backward
            logits = logits_bytes(model, shape, breakdown.tokens, p, output_loss,
                                  backward=False)
        forward = breakdown.tokens * block_transient_bytes_per_token(model, shape, p,
                                                                     backward=False)
        # under autocast on torch's own layers the no-grad forward's down projections run
        # through autocast too (no recomputing linear casts its own), so the cache ends up with
        # every block linear's copy, and it grows through the whole forward: at the last
        # block's SwiGLU (the peak) all of them but one are alive (the output layer's copy,
        # with whole logits, only from the loss on)
        cast = output_cast = 0
        if autocast_on_torch_layers(shape, p):
            cast, output_cast = autocast_weight_copies(model, p, output_loss, down=True)
        out = dataclasses.replace(out, activations=0, comm_buffers=0, gathered_weights=gathered,
                                  logits=logits, loss_forward=0, recompute=0,
                                  head_activations=0, last_block_activations=0,
                                  block_transient=forward + cast,
                                  cast_weights=cast + output_cast)
    return out
