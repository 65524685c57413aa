"""Turn a model into a 4D-parallel one with one call: `parallelize(model, grid, config)`.

Llama-family models (fourfold's own, and Hugging Face Llama/Mistral/Qwen2-style models, which
share the leaf names q_proj ... down_proj) get a plan that chains layouts with no resharding:
norm -> q/k/v (normal) -> attention on the local heads -> o (transposed) -> residual split over
x; norm -> gate/up (normal) -> down (transposed). Any other module gets each nn.Linear whose
shape divides the grid converted to a layer with whole inputs and outputs; the rest stays
replicated, with its gradients summed over the batch axes.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch import nn

from fourfold.config import CHOICES, ConfigError, ParallelConfig
from fourfold.intmath import divisors
from fourfold.parallel.buffers import GradBufferPool
from fourfold.parallel.comm import Comm, CommLedger
from fourfold.parallel.embedding import (BlockedOutputLoss, CrossEntropy, ParallelEmbedding,
                                         VocabParallelCrossEntropy, blocked_loss_applies,
                                         uses_blocked_loss)
from fourfold.parallel.engine import Engine, OverlapOptions
from fourfold.parallel.grid import Grid, GridError
from fourfold.parallel.layout import REPLICATED, Layout
from fourfold.parallel.linear import FusedLinears, Linear3D, ReplicatedLinear3D
from fourfold.parallel.lora import LoRAFactor
from fourfold.parallel.norm import ParallelRMSNorm
from fourfold.parallel.shards import full_specs, materialize, stream_full
from fourfold.safetensors_stream import TensorSpec

_NORMAL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # read the same input
_TRANSPOSED = ("o_proj", "down_proj")
_OUTPUT = ("output", "lm_head")
_EMBEDDING = ("embed", "embed_tokens")


class ParallelModel:
    """A model parallelized over a grid, and the engine that drives its communication."""

    def __init__(self, module: nn.Module, grid: Grid, comm: Comm, engine: Engine | None,
                 vocab_start: int | None) -> None:
        self.module = module
        self.grid = grid
        self.comm = comm
        self.engine = engine
        self._grad_groups: tuple[list[nn.Parameter], list[nn.Parameter]] | None = None
        self._layouts: dict[str, Layout] | None = None
        self._is_hf = hasattr(module, "config") and hasattr(module.config, "model_type")
        # The logits are whole on one process, under the generic plan (vocab_start is None) and
        # when y = 1: then the loss without the size-1 all-reduces.
        self.criterion: nn.Module | Any = (
            VocabParallelCrossEntropy(comm, vocab_start)
            if vocab_start is not None and grid.size("y") > 1 else CrossEntropy())

    # ---- running ----------------------------------------------------------------------------

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, T, V/Gy), or per-token losses (b, T) when targets are given. `documents`
        (b, T), for rows of packed documents, is handed to the module as it is (a fourfold
        model keeps attention inside each document)."""
        if self.engine is not None:
            self.engine.begin_forward(recompute=self._recomputes())
        packed = {} if documents is None else {"documents": documents}
        if self._is_hf:
            if documents is not None:
                raise ValueError("packed documents need a fourfold model; a Hugging Face "
                                 "module attends across them")
            logits = self.module(input_ids=tokens, use_cache=False).logits
        elif targets is not None and getattr(self.module, "output_loss", None) is not None:
            return self.module(tokens, targets, **packed)  # the output layer and the loss in blocks
        else:
            logits = self.module(tokens, **packed)
        if targets is None:
            return logits
        return self.criterion(logits, targets)

    forward = __call__

    def _recomputes(self) -> bool:
        """Whether this forward's blocks run again in backward (activation checkpointing)."""
        m = self.module
        return bool(m.training and torch.is_grad_enabled()
                    and (getattr(m, "activation_checkpointing", False)
                         or getattr(m, "is_gradient_checkpointing", False)))

    def train(self, mode: bool = True) -> "ParallelModel":
        self.module.train(mode)
        return self

    def eval(self) -> "ParallelModel":
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    @property
    def ledger(self) -> CommLedger:
        return self.comm.ledger

    # ---- gradients --------------------------------------------------------------------------

    def set_requires_gradient_sync(self, flag: bool) -> None:
        """False on all but the last micro-step of a step: skip the data all-reduce."""
        if self.engine is not None:
            self.engine.grad_sync = flag

    def finish_backward(self) -> None:
        """Wait for the engine's pending communication; call after every backward."""
        if self.engine is None:
            return
        if self._grad_groups is None:  # the parameters and their layouts never change
            layouts = self.layouts()
            named = list(self.module.named_parameters())
            self._grad_groups = ([p for n, p in named if "z" not in layouts[n].split_axes],
                                 [p for _, p in named])
        self.engine.finish_backward(*self._grad_groups)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip gradients by their total norm over the whole grid (each element counted once);
        returns the norm before clipping, a 0-d float64 tensor on the device (as torch's, so
        that nothing waits for the host). The same formula as torch.nn.utils.clip_grad_norm_."""
        layouts = self.layouts()
        by_replicas: dict[int, list[torch.Tensor]] = {}
        for name, p in self.module.named_parameters():
            if p.grad is not None and p.requires_grad:  # a frozen weight may hold a stale grad
                replicas = layouts[name].replicas(self.grid.shape)
                by_replicas.setdefault(replicas, []).append(p.grad.detach())
        grads = [g for group in by_replicas.values() for g in group]
        total = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        for replicas, group in by_replicas.items():
            # one fused norm per tensor; elements held by several ranks are counted once
            norms = torch._foreach_norm(group, 2.0)
            total += torch.stack(norms).double().pow(2).sum() / replicas
        total = self.comm.all_reduce(total, "tensor").wait()
        norm = total.sqrt()
        if max_norm > 0 and grads and math.isfinite(max_norm):
            # On the device, without asking the host whether to clip: one fused multiply by
            # min(1, coef) instead of a sync and a loop of small kernels.
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef)
        return norm

    def reduce_over_batch(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the batch axes (data and z); x/y replicas hold the same value."""
        if self.grid.world_size == 1:
            return t
        out = self.comm.all_reduce(t.detach().double().clone(), "all").wait()
        return (out / (self.grid.size("x") * self.grid.size("y"))).to(t.dtype)

    # ---- layouts and state --------------------------------------------------------------------

    def layouts(self) -> dict[str, Layout]:
        """The Layout of every parameter, by name (fixed once the model is parallelized)."""
        if self._layouts is None:
            self._layouts = self._find_layouts()
        return dict(self._layouts)

    def parameters_changed(self) -> None:
        """Parameters were added or frozen after parallelize (an adapter): forget the cached
        layouts and gradient groups."""
        self._layouts = None
        self._grad_groups = None

    def _find_layouts(self) -> dict[str, Layout]:
        by_id: dict[int, Layout] = {}
        for module in self.module.modules():
            if isinstance(module, (Linear3D, ParallelEmbedding)):
                by_id[id(module.weight)] = module.weight_layout
                if isinstance(module, Linear3D) and module.bias is not None:
                    by_id[id(module.bias)] = module.bias_layout
            elif isinstance(module, (ParallelRMSNorm, LoRAFactor)):
                by_id[id(module.weight)] = module.layout
        return {n: by_id.get(id(p), REPLICATED) for n, p in self.module.named_parameters()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors with the unparallelized names. Collective: every rank must call it."""
        layouts = self.layouts()
        params = dict(self.module.named_parameters())
        scratch = Comm(self.grid, CommLedger())  # not training traffic: keep the ledger clean
        gathered: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            key = id(tensor)
            if key not in gathered:
                layout = layouts.get(name, REPLICATED)
                if name not in params:  # a tied alias: find its parameter's layout
                    layout = next((layouts[n] for n, p in params.items() if p is tensor), layout)
                gathered[key] = _gather_full(tensor.detach(), layout, scratch)
            out[name] = gathered[key]
        return out

    def full_tensor_specs(self) -> list[TensorSpec]:
        """Name, dtype and full shape of each tensor `stream_full_tensors` yields, in order
        (each shared tensor once). No communication."""
        return full_specs(self.module, self.layouts(), self.grid)

    def stream_full_tensors(self, dst: int = 0) -> Iterator[tuple[TensorSpec, torch.Tensor | None]]:
        """The full tensors one at a time, on the CPU of rank `dst` (None on the others): no
        rank holds the whole model. Collective: every rank runs the iterator to its end."""
        return stream_full(self.module, self.layouts(), self.grid, dst)

    def memory_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes of this rank's parameters, of the gradients alive now and of a torch
        optimizer's state tensors."""
        params = list(self.module.parameters())
        out = {"params": sum(p.numel() * p.element_size() for p in params),
               "grads": sum(p.grad.numel() * p.grad.element_size()
                            for p in params if p.grad is not None),
               "optimizer": 0}
        if optimizer is not None:
            for state in optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        out["optimizer"] += v.numel() * v.element_size()
        return out


def _gather_full(local: torch.Tensor, layout: Layout, comm: Comm) -> torch.Tensor:
    t = local
    for dim in reversed(range(len(layout.dims))):
        for axis in reversed(layout.dims[dim]):  # innermost split first
            if comm.grid.size(axis) == 1:
                continue
            moved = t.movedim(dim, 0).contiguous()
            t = comm.all_gather(moved, axis).wait().movedim(0, dim).contiguous()
    return t


# --------------------------------------------------------------------------------------------


REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def overlap_options(cfg: ParallelConfig | None) -> OverlapOptions:
    if cfg is None:
        return OverlapOptions()
    if cfg.reduce_dtype not in REDUCE_DTYPES:
        raise ConfigError(f"parallel.reduce_dtype = {cfg.reduce_dtype!r}: choose one of "
                          f"{', '.join(REDUCE_DTYPES)}")
    return OverlapOptions(input_grad=cfg.overlap_input_grad, weight_grad=cfg.overlap_weight_grad,
                          prefetch=cfg.prefetch_weights, data_grad=cfg.overlap_data_grad,
                          bucket_bytes=cfg.bucket_bytes, gemm_tuning=cfg.gemm_tuning,
                          reduce_dtype=REDUCE_DTYPES[cfg.reduce_dtype],
                          forward_split=cfg.overlap_forward)


def parallelize(model: nn.Module, grid: Grid, config: ParallelConfig | None = None, *,
                blocked_loss: bool = False,
                grad_buffers: GradBufferPool | None = None) -> ParallelModel:
    """Parallelize `model` over `grid`: a model with its full weights, the same on every rank,
    or one declared on the meta device (`build_model(cfg, seed, device="meta")`), of which
    each rank materialises only its own shards, on grid.device, with the values a one-process
    build of the same seed has.

    Modules are replaced in place. On a one-process grid with GEMM tuning off (the default)
    the model is left as it is; with tuning on its linears become fourfold's own, whose GEMMs
    the tuner chooses, and with parallel.engine = "always" the whole engine runs as on a grid.
    `blocked_loss`: parallel.output_loss = "auto" gives the output layer and
    loss a block of the vocabulary at a time (embedding.uses_blocked_loss; the training
    method's choice). `grad_buffers`: where the engine keeps a released gradient's buffer for
    the next gradient of its shape (parallel/buffers.py; None: nowhere).
    """
    comm = Comm(grid)
    options = overlap_options(config)
    output_loss = config.output_loss if config is not None else "auto"
    engine_mode = config.engine if config is not None else "auto"
    for key, value in (("output_loss", output_loss), ("engine", engine_mode)):
        modes = CHOICES[("parallel", key)]  # what a config file may say, checked there too
        if value not in modes:
            raise ConfigError(f"parallel.{key} = {value!r}: choose one of {', '.join(modes)}")
    if grid.world_size == 1 and not options.gemm_tuning and engine_mode == "auto":
        pmodel = ParallelModel(model, grid, comm, None, None)
        materialize(model, pmodel.layouts(), grid)
        _set_output_loss(model, uses_blocked_loss(output_loss, blocked_loss), None, 0)
        return pmodel
    engine = Engine(comm, options, grad_buffers)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if set(_NORMAL + _TRANSPOSED) <= names:
        vocab_start = _apply_llama_plan(model, grid, engine)
    else:
        _apply_generic_plan(model, grid, engine)
        vocab_start = None
    pmodel = ParallelModel(model, grid, comm, engine, vocab_start)
    # a meta-device model's shards were cut as meta tensors; each rank computes just its own
    materialize(model, pmodel.layouts(), grid)
    if vocab_start is None or not hasattr(model, "criterion"):
        return pmodel
    model.criterion = pmodel.criterion  # the model's own loss path uses the split vocabulary too
    _set_output_loss(model, uses_blocked_loss(output_loss, blocked_loss),
                     comm if grid.size("y") > 1 else None, vocab_start)
    return pmodel


def _set_output_loss(model: nn.Module, blocked: bool, comm: Comm | None,
                     vocab_start: int) -> None:
    """Give a fourfold model the blocked output layer and loss where parallel.output_loss
    asks for it (`blocked`) and its output layer allows it."""
    if not hasattr(model, "output_loss") or not hasattr(model, "output"):
        return
    blocked = blocked and blocked_loss_applies(model.output)
    model.output_loss = BlockedOutputLoss(comm, vocab_start, model.criterion) if blocked else None


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def _check_heads(model: nn.Module, grid: Grid) -> None:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    if cfg is None:
        return
    heads = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    kv = (getattr(cfg, "n_kv_heads", None) or getattr(cfg, "num_key_value_heads", None)
          or heads)
    gy = grid.size("y")
    for what, n in (("attention heads", heads), ("key/value heads", kv)):
        if n and n % gy:
            raise GridError(f"parallel.y = {gy} does not divide the model's {n} {what}; "
                            f"choose y among {', '.join(map(str, divisors(n)))}")


def _apply_llama_plan(model: nn.Module, grid: Grid, engine: Engine) -> int:
    _check_heads(model, grid)
    modules = list(model.named_modules())
    embedding: ParallelEmbedding | None = None
    for name, module in modules:
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and leaf in _EMBEDDING:
            embedding = ParallelEmbedding(module, grid, engine)
            tied_weight = module.weight
            _set_submodule(model, name, embedding)
        elif _is_rms_norm(module) and leaf.endswith("norm"):
            eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", 1e-6)
            _set_submodule(model, name, ParallelRMSNorm(module.weight, float(eps), grid, engine,
                                                        fan_out_to_y=True))
    for name, module in modules:
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.Linear):
            continue
        if leaf in _NORMAL:
            new = Linear3D(module, grid, engine, transposed=False, own_fan_out=False)
        elif leaf in _TRANSPOSED:
            new = Linear3D(module, grid, engine, transposed=True, own_fan_out=True)
        elif leaf in _OUTPUT:
            tied = embedding is not None and module.weight is tied_weight
            new = Linear3D(module, grid, engine, transposed=False, own_fan_out=False,
                           weight=embedding.weight if tied else None)  # type: ignore[union-attr]
        else:
            continue
        _set_submodule(model, name, new)
    _fuse_shared_inputs(model)
    _order_for_prefetch(engine, model)
    return embedding.vocab_start if embedding is not None else 0


def _fuse_shared_inputs(model: nn.Module) -> None:
    """q, k, v (and gate, up) of one parent read the same input: one GEMM and one collective
    for each group; their weights stay separate parameters."""
    for parent in model.modules():
        for leaves in _FUSED:
            members = [getattr(parent, leaf, None) for leaf in leaves]
            if all(isinstance(m, Linear3D) and m.fused is None for m in members):
                FusedLinears(members)  # type: ignore[arg-type]


def _order_for_prefetch(engine: Engine, model: nn.Module) -> None:
    """Forward order of the z-sharded modules: definition order, which Llama-family models
    run in (embedding, then each block's q, k, v, o, gate, up, down, then the output), and the
    block of each: its name up to the first index of a module list ("layers.3"), which is what
    activation checkpointing recomputes whole."""
    units: list[tuple[str, Any]] = []
    for name, m in model.named_modules():
        if isinstance(m, Linear3D) and m.fused is not None:
            if m is m.fused.members[0]:  # a fused group gathers once, where its first reads
                units.append((name, m.fused))
        elif isinstance(m, (Linear3D, ParallelEmbedding)):
            units.append((name, m))
    engine.set_order([m for _, m in units], [_block_of(n) for n, _ in units])


def _block_of(name: str) -> str | None:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return None


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1
            and not isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm))
            and getattr(module, "bias", None) is None
            and len(list(module.children())) == 0)


def _apply_generic_plan(model: nn.Module, grid: Grid, engine: Engine) -> None:
    gx, gyz = grid.size("x"), grid.size("y") * grid.size("z")
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and module.in_features % gx == 0 \
                and module.out_features % gyz == 0 and module.out_features % grid.size("y") == 0:
            _set_submodule(model, name, ReplicatedLinear3D(module, grid, engine))
    _order_for_prefetch(engine, model)
