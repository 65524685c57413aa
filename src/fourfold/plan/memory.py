"""Memory per rank of a 4D configuration: parameters, gradients, AdamW states, activations
(with and without activation checkpointing), gathered-weight buffers, the data-parallel
gradient buckets, the transients of building the model in shards and of exporting it, an
asynchronous checkpoint's snapshot, and (on a host) the runtime's own growth.

`predict_memory` is the rank model: one MemoryBreakdown, each term named below with the
measurement it rests on (bench/memory.py, whose --phases table gives VmRSS, VmHWM and glibc's
heap in use at each phase of a run; float32, 2 steps of 8 x 64 tokens, sync and async
checkpoint, the streamed export):
- params, grads, optimizer: local_param_numel x bytes (tests/test_parallel.py checks them
  against the built model); the heap in use after the first optimizer step equals them plus
  a few MiB on every preset;
- activations, logits: autograd's saved tensors (tests/test_memory_model.py); the forward's
  end in --phases is the model state plus these;
- block_transient: one block's temporaries beyond what it saves (its backward's, at the
  SwiGLU's gradient; MeZO's and ES's no-grad forward). The logits are gone before any block's
  backward, so a step counts the larger of the logits and one block's recompute plus these:
  at thousands of tokens a block outweighs a blocked loss (tests/test_lean_optim.py checks
  the total against the heap in use at every op of a 2,048-token step; on an H200, 125m at
  16 x 512 tokens, bench/memory_lean.py --device cuda);
- loss_grads: the gradients alive at the loss, none unless micro-steps accumulate them (AdamW
  sets them to None before the forward; the other methods free theirs within a step): with
  whole logits larger than a block's backward the loss is the peak, and counting every
  gradient there read +18.8% against the heap (tests/test_lean_optim.py, a 32,000-token
  vocabulary) and +11.9% on an H200 (125m, 16 x 512 tokens; -1.1% now, from the same
  measurement: the GPU was not lent again);
- gathered_weights: the z all-gather buffers (current + prefetched) and one dW block;
- comm_buffers: what the data all-reduce holds beyond the gradients, which are views of
  their buckets' buffers (parallel/data_parallel.py): a lower reduce_dtype's casts;
- startup: one init tile (on a host); export: one block, and the export writer's full tensor
  (on a host);
- checkpoint: the async snapshot (params and AdamW states copied to host memory), which is
  alive through the next step: on a CPU rank it alone is 0.375x the model's float32 weights
  on 8 ranks, so an async checkpoint keeps such a rank above 0.5 + 0.375 = 0.875x;
- runtime (on a host): what a rank touches beyond a process that imported fourfold, not as
  tensors: library code and data first used by a step, gloo's and the checkpoint writer's threads,
  the interpreter's objects; a constant ~40 MiB per rank on every preset measured (15m: 37-59 MiB
  above the other terms on 1-8 ranks), 27 MiB for MeZO and ES (HOST_FORWARD_ONLY_RUNTIME_BYTES:
  no backward; on a grid rank with torch's flight recorder off, as `fourfold train` runs CPU
  ranks, fourfold.host.FLIGHT_RECORDER_ENVIRONMENT). Under bfloat16 it includes
  oneDNN's primitive cache (each bfloat16 GEMM's kernel, kept from its first call: 5 MiB of heap
  on one process, 6.5 on a 2 x 2 rank, small preset; none in float32, whose GEMMs are MKL's),
  which bench/heap_peak.py's heap reads beside the tensors. Not MKL's buffers: CPU ranks run with
  its cache off (fourfold.host.MKL_ENVIRONMENT; it kept up to 23 MiB of heap on a GaLore rank, 5
  after one float64 GEMM). AdamW's runs (torch.optim) and compiled ones add torch._dynamo's
  import, 70 MiB (TORCH_DYNAMO_BYTES), which the other methods load only on a grid that writes
  checkpoints (a DTensor imports it). A run that writes checkpoints adds the checkpoint library's
  import (library_bytes): 45 MiB, 2 once torch._dynamo is in. `fourfold train` on 2x2, 15m, 8 x
  128 tokens, rank 0's peak with checkpoints every 2 steps against none: AdamW 246 against 247
  MiB, LOMO 136 against 189, MeZO 63 against 139, GaLore 145 against 222.
On CPU the allocator keeps freed blocks for reuse (train/host_memory.py) and, so tuned, its
resident memory stays within a few percent of the heap in use. Measured with it, 350m preset,
8 ranks (x2 y2 z2): 1,019-1,042 MiB per rank with a sync checkpoint (predicted 1,010),
1,533-1,561 with an async one (predicted 1,545); 15m: within 7% on 1-8 ranks here; but what
the heap cannot reuse depends on when gloo's threads allocate: 15m at z = 2, whose heap in use
peaks at the same 160 MiB in every run, read 188-207 MiB on one machine and 225 (18% over the
predicted 191) on another.

What a rank holds that the model leaves out, and why:
- the runtime's import itself (Python, torch's libraries, on a GPU the CUDA context): the
  search takes `reserved_gib` per rank off for it (`Machine.usable_memory_bytes`);
- the token shards, which are memory-mapped, and unmapped after each batch's reads (they stay
  in the page cache, outside the process's resident memory: data/loader.py);
- the optimizer step's and the gradient norm's temporaries (a few tensors of one layer's size);
- on a GPU, the caching allocator's slack (its fragmentation is not modelled);
- on a CPU rank of a grid, the heap pages that a step's blocks wander onto beyond the heap in
  use. Since stop 51 the ranks run with torch's flight recorder off (fourfold.host), whose
  per-collective blocks did most of the scattering: 15m, 2x2, 12 steps, every method within
  8.5% (ES 49.4-51.5 MiB over seven runs, planned 48.5). Before it (where glibc places them,
  which gloo's late frees and MKL's per-GEMM buffers move: ES's heap in use flat at 24 MiB,
  its extent 43-59; train/host_memory.py's trim_on_host_grid):
  15m, 2x2, 8 x 128 tokens, after 12 steps rank 0 read up to 15.4% above the prediction
  (stop 49: two runs of each method, AdaLomo and GaLore 12.7-14.4%; at 30 steps GaLore
  14.7-16.1%, three runs; stop 51: AdaLomo above 15% in one of ten runs, its statistics'
  all-reduces during backward leaving it 9-14 MiB above LOMO) and ES up to 28.5% (above 15%
  in five runs of nineteen at stop 49, up to 21.9%, and five of fifteen at stop 50) (within
  10% at 4 steps); 125m's ranks stay within 7% at 10.

The search compares the total with `Machine.usable_memory_bytes`, which divides a memory shared
by several ranks (a host's) among them and takes `reserved_gib` per rank off for the runtime.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fourfold.config import ModelConfig
from fourfold.parallel.data_parallel import in_flight_wire_bytes
from fourfold.parallel.embedding import (NO_GRAD_LOSS_BLOCK_ELEMENTS, output_loss_columns,
                                         uses_blocked_loss)
from fourfold.parallel.grid import GridShape
from fourfold.plan.errors import PlanError
from fourfold.plan.schedule import block_linears, local_param_numel

if TYPE_CHECKING:
    from fourfold.config import TrainConfig

GIB = 1024**3


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

    @property
    def step(self) -> int:
        """The peak of a training step beyond the parameters and optimizer state: the larger of
        the loss and one block's backward, which are never alive together (the logits are gone,
        the output layer's backward done, before any block's backward starts). The loss holds
        the logits, `cast_weights` (under autocast on one process) and `loss_grads`: no
        gradient with grad_accum = 1 (every method frees or hands off its gradients within a
        step; AdamW sets them to None before the forward), all of them on the micro-steps
        after the first with grad_accum > 1. A block's backward holds its recomputed
        activations, the temporaries of its gradients (`block_transient`) and `grads`, every
        gradient: an upper bound, as the gradients grow while the blocks' saved inputs are
        freed. Without a backward (mezo, es) `block_transient` is a block's
        no-grad forward, with (under autocast on one process) every block linear's cached
        compute-dtype copy, which the cache gathers through the forward.
        Autocast lets its copies go as the forward ends, the loss's forward included: they
        meet only `loss_forward` of the loss, where that is less than `logits` (the blocked
        loss, whose backward makes the output layer's dW and casts its weight anew; 125m, 2 x
        128 tokens, bfloat16 LOMO: the heap's peak 15% below the planner before)."""
        alive = (self.activations - self.recompute + self.gathered_weights + self.comm_buffers
                 + self.checkpoint)
        loss = max(self.cast_weights + (self.loss_forward or self.logits), self.logits)
        return alive + max(self.loss_grads + loss,
                           self.grads + self.recompute + self.block_transient)

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
    keep (`outside`). Measured against autograd's saved tensors in tests/test_memory_model.py.

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
    # norm's output (q, k and v three, gate and up two); measured on the heap, small preset,
    # bfloat16: 2 d bytes a token a block more than one float32 output a norm
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
    outside = d // gx * (residual + act) + 4 + 9
    return {"block": norm_inputs * residual + (norm_outputs + attention + mlp) * act + stats,
            "checkpoint": d // gx * residual, "outside": outside}


def block_transient_bytes_per_token(model: ModelConfig, shape: GridShape, precision: Precision,
                                    backward: bool = True) -> int:
    """Per token on a rank: the most a block holds at once beyond what it saved for backward,
    at its feed-forward part (wider than attention's: ffn_dim against the heads).

    backward: at the SwiGLU's gradient (models/llama.py: dy, d_up, the bracket and dy * up
    beside gate and up), three ffn-wide tensors on top of the recompute's saved ones, a figure
    fitted to measurement. Without a backward (mezo, es): the block's input, the residual after
    attention and the normalized input, with gate, up, silu(gate) and their product. Checked:
    tests/test_lean_optim.py (the small preset at 2,048 tokens, the heap in use after every
    op, within 10%) and, on an H200, bench/memory_lean.py --device cuda --preset 125m --batch
    16 --seq 512 (max_memory_allocated: LOMO 1,443 MiB, planner +2.6%; MeZO 875, -4.0%)."""
    d, f = model.dim // shape.x, model.ffn_dim // shape.y
    if backward:
        return 3 * f * precision.act_bytes
    return 3 * d * precision.residual_bytes + 4 * f * precision.act_bytes


HOST_RUNTIME_BYTES = 40 * 2**20  # measured: see the module docstring (runtime)
# ... and for MeZO and ES (no backward): `fourfold train`, 8 x 128 tokens, 4 steps, read 27-28
# MiB above the other terms in one process at the small and 15m presets (the backward methods
# 32-39 there); on a CPU rank of a grid, since its flight recorder is off (fourfold.host), ES
# and MeZO read 27-32 (15m 2x2, 12 steps; 125m 2x2, bench/memory_lean.py --steps 4)
HOST_FORWARD_ONLY_RUNTIME_BYTES = 27 * 2**20
# the methods that train from forward passes alone (train/methods/zeroth.py)
FORWARD_ONLY_METHODS = ("mezo", "es")
# torch._dynamo, which torch.optim (AdamW) and train.compile import at their first use: 70.6
# MiB resident (a process that imported fourfold, then torch._dynamo); so does a grid's
# checkpoint (loads_dynamo), nothing else in a run (models/recompute.py, meta builds)
TORCH_DYNAMO_BYTES = 70 * 2**20
# torch.distributed.checkpoint (with DTensor, sympy and torch.fx), imported at a run's first
# checkpoint: 44.5 MiB resident above `import fourfold`, 1.7 MiB where torch._dynamo is in
# already (they share sympy and torch.fx); torch._dynamo after it adds 28 MiB, not 70.
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
    """Whether a run imports torch._dynamo: AdamW (torch.optim), train.compile, or a grid's
    checkpoint (DTensor.from_local); nothing else in a run does (models/recompute.py,
    build_model on the meta device)."""
    return (train.optimizer == "adamw" or train.compile
            or (checkpoints and shape.size > 1))


INIT_TILE_BYTES = 1024 * 1024 * 4  # fourfold.models.init: one float32 tile drawn at a time
DEFAULT_BUCKET_BYTES = 25 * 2**20  # parallel.bucket_mb
GALORE_CHUNK_BYTES = 4 * 2**20  # train/methods/galore.py: gathered columns per Gram chunk
# train/methods/blockllm.py: a selection's backward keeps each handed-off gradient whole (no
# copy) until the rows it holds exceed the budget by this share of all elements, then ranks
# them and keeps the budget's worth: at sparsity 0.9 about 18 rankings and compactions a
# selection whatever the number of tensors (one per hand-off before: on 125m, one process,
# the selection step's own work fell from 1.3 to 0.5 s), for up to this share of the
# gradients' bytes more at its peak
BLOCKLLM_HOLD_SLACK = 0.05


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
    float32 (against the heap, bfloat16: -22% before the copy counted).
    The blocked loss: one block of columns of them in float32 (below float32 also its two
    copies in the compute dtype), plus two floats a token kept for backward; with a
    `backward`, the output layer's backward also holds its weight gradient (float32), and
    below float32 the weight's compute-dtype copy (bfloat16, against the heap: LOMO -14% before
    it counted) and, on a grid, the gradient made in that dtype, cast to float32 after the
    block loop (on one process it is made in float32 block by block)."""
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
            # float32 gradient after it, when the blocks' transients are gone (the heap's peak,
            # 2 x 2 LOMO rank, small preset, bfloat16: in the loop; counting the gradient there
            # too read +17%)
            return max(out, block * precision.grad_bytes + 8 * tokens) + block * 2 * act
        out += block * (precision.grad_bytes + (act if act < 4 else 0))
    return out


def predict_memory(model: ModelConfig, shape: GridShape, micro_batch_tokens: int,
                   activation_checkpointing: bool, precision: Precision, *,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, on_host: bool = False,
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
    # output layer's. Without
    # activation checkpointing each layer also saves its copy for backward, until its own
    # backward: saved activations then (measured: a block's saved bytes less its weights'
    # copies match `block` within 1%)
    cast_weights = 0
    if autocast_on_torch_layers(shape, precision):
        cast = sum(autocast_weight_copies(model, precision, output_loss, down=False))
        if activation_checkpointing:
            cast_weights = cast
        else:
            activations += cast
    # the gradients are views of their buckets' buffers, all-reduced in place: beyond them only
    # a lower reduce_dtype's casts of the buckets in flight
    comm_buffers = (in_flight_wire_bytes(bucket_bytes, precision.grad_bytes,
                                         precision.reduce_bytes) if shape.data > 1 else 0)
    full_numel, block_numel = largest_tensor_numel(model, shape)
    # parallel/shards.py materialize: each block is drawn on the host a tile at a time into
    # the float32 tensor that becomes the parameter (on a GPU it is moved there: the device
    # holds it once, as the parameter), so beyond the weights only the tile is alive, on the
    # host. Measured (125m, bench/memory_lean.py --phases --tuned-malloc): the build's heap
    # peaks at the weights + 7 MiB on one process and on 2x2 alike
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


def galore_rank(full_shape: tuple[int, ...], rank: int) -> int:
    """GaLore's projection rank of a matrix: `rank` (0: a quarter of the smaller side), at most
    the smaller side, at least 1 (train/methods/galore.py uses this rule)."""
    small = min(full_shape)
    return max(1, min(small, rank if rank > 0 else small // 4))


def method_state_bytes(model: ModelConfig, shape: GridShape, train: "TrainConfig",
                       precision: Precision | None = None) -> dict[str, int]:
    """Per rank, the peak gradient bytes and the optimizer-state bytes of train.optimizer.

    adamw: every gradient, two moments. lomo / adalomo: one tensor's gradient at a time (the
    largest block; with data > 1 the buffers of up to two buckets, not counted); adalomo keeps a
    row and a column statistic per matrix, a second moment per vector. mezo / es: neither.
    blockllm: moments and gradients of the selected (1 - block_sparsity) share of the rows, a
    step count per row; a selection step's backward holds up to BLOCKLLM_HOLD_SLACK of the
    elements more before it ranks them, and the tensor being handed off (the largest block)
    and the vectors (with grad_accum > 1 every gradient lives until the last micro-step).
    galore: R, the projected gradient of every matrix (the moments' size), the
    vectors' gradients and the matrix being handed off (the largest block; with grad_accum > 1
    every gradient, until the last micro-step); per matrix its projection (local rows of the
    projected side x r, r split over the other side's axes where they divide it) and two
    r-rank moments (r split over the projected side's axes where they divide it); vectors
    plain AdamW."""
    p = precision or Precision.of("float32")
    numel = sum(local_param_numel(model, shape).values())
    matrices = local_matrices(model, shape)
    vectors = numel - sum(rl * cl for _, _, rl, cl in matrices)
    state_bytes = p.optimizer_bytes // 2  # one float32 state tensor per element
    name = train.optimizer
    if name == "adamw":
        return {"grads": numel * p.grad_bytes, "optimizer": numel * p.optimizer_bytes}
    if name in ("lomo", "adalomo"):
        grads = largest_tensor_numel(model, shape)[1] * p.grad_bytes
        if name == "lomo":
            return {"grads": grads, "optimizer": 0}
        factored = sum(rl + cl for _, _, rl, cl in matrices) + vectors
        return {"grads": grads, "optimizer": factored * state_bytes}
    if name in FORWARD_ONLY_METHODS:
        return {"grads": 0, "optimizer": 0}
    if name == "blockllm":
        selected = int(numel * (1.0 - train.block_sparsity))
        handed_off = largest_tensor_numel(model, shape)[1] + vectors
        held = selected + int(numel * BLOCKLLM_HOLD_SLACK)  # held rows before a ranking
        grads = numel if train.grad_accum > 1 else min(numel, held + handed_off)
        # and a float32 step count per chosen row (rows are at least dim wide)
        rows = math.ceil(selected / model.dim)
        return {"grads": grads * p.grad_bytes,
                "optimizer": selected * p.optimizer_bytes + 4 * rows}
    if name == "galore":
        state, projected = 2 * vectors, 0
        for m, n, rl, cl in matrices:
            r = galore_rank((m, n), train.galore_rank)
            # m < n: P (local rows x r), moments r x local cols; else Q and m_local x r moments;
            # the moments' r split as the projected side is, where that divides r
            parts = m // rl if m < n else n // cl
            rr = r // parts if r % parts == 0 else r
            # P's (Q's) r columns split as the other side is, where that divides r
            others = n // cl if m < n else m // rl
            pr = r // others if r % others == 0 else r
            state += rl * pr + 2 * rr * cl if m < n else cl * pr + 2 * rl * rr
            projected += rr * cl if m < n else rl * rr
        handed_off = largest_tensor_numel(model, shape)[1]
        grads = numel if train.grad_accum > 1 else projected + vectors + handed_off
        return {"grads": grads * p.grad_bytes, "optimizer": state * state_bytes}
    raise PlanError(f"train.optimizer = {name!r}: no memory model for it")


def galore_update_bytes(model: ModelConfig, shape: GridShape, train: "TrainConfig") -> int:
    """GaLore's largest transient after backward (every gradient and the moments still held),
    the largest over the matrices of:
    - a projection refresh (the first step and every galore_gap-th), s = min(m, n): the s x s
      float64 Gram while a chunk of the shard is gathered to its full small side (float32,
      GALORE_CHUNK_BYTES at most, and its float64 copy), then eigh's input, output and
      workspace (syevd: about 2 s^2), 4 s^2 float64 in all, measured on CPU for s = 3072:
      4.2 s^2 at eigh's peak;
    - an update, a block of the other side at a time (w of its columns for P, rows for Q,
      the update back in the shard's basis GALORE_CHUNK_BYTES at most): P (Q) gathered to
      its r columns where they are split, and per block R (r x w) before its reduce-scatter,
      this rank's share of it, Adam's step of the share (two temporaries) and the step
      gathered back, and the update back in the shard's basis.
    The refresh's is the larger but for tiny matrices; it does not shrink with the grid
    (4 s^2 float64 on every rank: 128 MiB at s = 2048)."""
    worst = 0
    for m, n, rl, cl in local_matrices(model, shape):
        s, r = min(m, n), galore_rank((m, n), train.galore_rank)
        width = min(max(1, GALORE_CHUNK_BYTES // (4 * s)), cl if m < n else rl)
        refresh = max(8 * s * s + 12 * s * width, 32 * s * s)
        # P's side of the shard, the side the blocks cut; the axes' parts that split R's r
        # (the projected side's) and P's r (the other side's)
        side, other = (rl, cl) if m < n else (cl, rl)
        parts, others = (m // rl, n // cl) if m < n else (n // cl, m // rl)
        share = parts if r % parts == 0 else 1
        gathered = side * r if others > 1 and r % others == 0 else 0
        w = min(other, max(1, GALORE_CHUNK_BYTES // (4 * side)))
        low = r * w
        worst = max(worst, refresh, 4 * (gathered + side * w + low + 2 * (low // share)))
    return worst


def predict_method_memory(breakdown: MemoryBreakdown, model: ModelConfig, shape: GridShape,
                          train: "TrainConfig", precision: Precision | None = None,
                          output_loss: str = "auto", checkpoints: bool = False
                          ) -> MemoryBreakdown:
    """`breakdown` (predict_memory's, which counts AdamW) with train.optimizer's gradients and
    state; mezo and es run forwards only: no saved activations, no dW or gradient buckets.
    galore: its update's temporaries (`update`, galore_update_bytes), after backward.
    `output_loss`, `checkpoints`: as predict_memory had them (on a host the runtime counts the
    libraries this run imports: library_bytes).

    Checked with bench/memory_lean.py (125m, 2 x 128 tokens; --phases gives the heap in use at
    each method's peak): the live tensors at each peak are these terms. Resident memory under
    glibc's default tuning reads up to ~200 MiB above them on one process (freed blocks it
    keeps: AdaLomo's row blocks, ES's noise chunks) and more on gloo ranks (an arena per
    thread); with the tuning `fourfold train` gives CPU ranks (--tuned-malloc) it does not."""
    p = precision or Precision.of("float32")
    states = method_state_bytes(model, shape, train, p)
    out = dataclasses.replace(breakdown, grads=states["grads"], optimizer=states["optimizer"],
                              loss_grads=states["grads"] if train.grad_accum > 1 else 0)
    if out.runtime:  # predict_memory counted AdamW's libraries
        own = (HOST_FORWARD_ONLY_RUNTIME_BYTES if train.optimizer in FORWARD_ONLY_METHODS
               else HOST_RUNTIME_BYTES)
        out = dataclasses.replace(out, runtime=own + library_bytes(
            loads_dynamo(train, shape, checkpoints), checkpoints))
    if train.optimizer == "galore":
        out = dataclasses.replace(out, update=galore_update_bytes(model, shape, train))
    if train.optimizer in FORWARD_ONLY_METHODS:
        layer_block = sum(lin.out_features * lin.in_features for lin in block_linears(model))
        layer_block //= shape.x * shape.y
        gathered = 2 * layer_block * p.weight_bytes if shape.z > 1 else 0
        # a no-grad forward's peak is its loss or one block's forward, whichever is larger
        # (MemoryBreakdown.step). The loss: the logits (and their float32 copy when they are
        # not float32) and one block of rows of the loss's temporaries (parallel/embedding.py
        # works a loss without backward block by block). Before the blocks:
        # bench/memory_lean.py --phases, 125m, 256 tokens read 96 MiB in use above the
        # weights, 3 x the 31 MiB of logits
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
        # block's SwiGLU (the peak) all of them but one are alive. Found on the heap (15m,
        # bfloat16, 8 x 512): -12% before; on an H200 (125m, 16 x 512) MeZO and ES read -22.6%
        # (the output layer's copy, with whole logits, only from the loss on)
        cast = output_cast = 0
        if autocast_on_torch_layers(shape, p):
            cast, output_cast = autocast_weight_copies(model, p, output_loss, down=True)
        out = dataclasses.replace(out, activations=0, comm_buffers=0, gathered_weights=gathered,
                                  logits=logits, loss_forward=0, recompute=0,
                                  block_transient=forward + cast,
                                  cast_weights=cast + output_cast)
    return out
