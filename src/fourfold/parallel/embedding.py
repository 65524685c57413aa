"""Parallel embedding and cross-entropy over a vocabulary split across y.

The embedding table E[V, D] has the layout of a normal linear's weight (V over y then z, D over
x), so a tied output layer shares the very same shard. Looking up a token: each y-rank fills the
rows its vocabulary slice owns, zeros elsewhere, and an all-reduce over y completes the residual
stream (split over x). The loss never gathers the logits: the max, the sum of exponentials and
the target logit are reduced over y as (b*T)-sized vectors.

BlockedOutputLoss runs the output layer and the loss together a block of the vocabulary at a
time (parallel.output_loss), so that no logits-sized tensor exists in forward or backward: it
keeps each row's log-sum-exp and makes a block's logits again in backward. On the 125m preset, batch
2 x 128, one process, that is 31 MiB of logits and their float32 softmax less at LOMO's peak
(bench/memory_lean.py); with a 128k vocabulary and 8k tokens a micro-step, 4 GiB a tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fourfold.parallel.comm import Comm
from fourfold.parallel.engine import Engine, keeps_output_block
from fourfold.parallel.grid import Grid
from fourfold.parallel.layout import Layout
from fourfold.parallel.linear import Linear3D, compute_dtype


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight_shard: torch.Tensor,  # type: ignore[override]
                module: "ParallelEmbedding") -> torch.Tensor:
        engine = module.engine
        device = tokens.device.type
        compute = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                   else module.weight.dtype)  # what the next gathers (prefetched here) use
        w = engine.gather_weight(module, "forward", compute)  # (V/Gy, D/Gx)
        local = tokens - module.vocab_start
        owned = (local >= 0) & (local < w.shape[0])
        local = local.masked_fill(~owned, 0)
        out = F.embedding(local, w) * owned.unsqueeze(-1).to(w.dtype)
        out = engine.comm.all_reduce(out, "y").wait()
        ctx.module = module
        ctx.save_for_backward(local, owned)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        module: ParallelEmbedding = ctx.module
        local, owned = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:  # a frozen table: no gradient, no reduce-scatter
            return None, None, None
        # grad is the same on every y-rank (the output was replicated), so each rank keeps
        # the rows it owns: the all-reduce's backward is the identity.
        block = module.engine.grad_buffer(module.block_shape, torch.float32,
                                          grad.device).zero_()
        g = grad.float().reshape(-1, grad.shape[-1])
        # Rows of tokens another rank owns add zeros to row 0 (local was set to 0 for them):
        # the same sums as selecting the owned rows, without the host sync that boolean-mask
        # indexing costs on a GPU (it must learn how many rows there are).
        g = g.masked_fill(~owned.reshape(-1, 1), 0.0)
        block.index_add_(0, local.reshape(-1), g)
        module.engine.reduce_scatter_weight_grad(module.weight, block)
        return None, None, None


class ParallelEmbedding(nn.Module):
    def __init__(self, embedding: nn.Embedding, grid: Grid, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self.weight_layout = Layout((("y", "z"), ("x",)))
        shape, coords = grid.shape, grid.shape.coords(grid.rank)
        V, D = embedding.weight.shape
        local = self.weight_layout.local_shape((V, D), shape, f"Embedding({V}, {D})")
        self.block_shape = (local[0] * grid.size("z"), local[1])
        self.vocab_start = grid.coord("y") * self.block_shape[0]
        self.needs_backward_gather = False
        self.weight = nn.Parameter(self.weight_layout.shard(embedding.weight.detach(), shape, coords),
                                   requires_grad=embedding.weight.requires_grad)
        engine.register(self)

    def gather_shard(self, compute_dtype: torch.dtype) -> torch.Tensor:
        """Its shard in its own dtype: a lookup is no GEMM, and autocast leaves it in float32."""
        return self.weight.detach()

    def arrange(self, gathered: torch.Tensor) -> torch.Tensor:
        return gathered.view(self.block_shape)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _EmbeddingFunction.apply(tokens, self.weight, self)


# elements of logits per block when a loss needs no backward: a bounded temporary (4 MiB of
# float32) instead of logits-sized ones (the planner's memory model counts one block)
NO_GRAD_LOSS_BLOCK_ELEMENTS = 1 << 20


def _rows_per_block(width: int) -> int:
    return max(1, NO_GRAD_LOSS_BLOCK_ELEMENTS // max(1, width))


def _sum_exp_by_rows(lf: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """exp(lf - shift).sum(-1), one block of rows at a time: each row's sum is what the whole
    tensor's would give (rows are independent), with one block's temporary."""
    flat, flat_shift = lf.reshape(-1, lf.shape[-1]), shift.reshape(-1, 1)
    step = _rows_per_block(flat.shape[-1])
    out = torch.empty(flat.shape[0], dtype=lf.dtype, device=lf.device)
    for i in range(0, flat.shape[0], step):
        out[i:i + step] = (flat[i:i + step] - flat_shift[i:i + step]).exp_().sum(-1)
    return out.view(shift.shape)


class _SoftmaxCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy whose backward holds one logits-sized tensor: the softmax,
    made in place from the exponentials and turned into the logits' gradient in place. With a
    comm, the logits are this y-rank's vocabulary slice and the row statistics are reduced over
    y; without one (None), they are whole. (F.cross_entropy keeps its log-softmax, and its
    backward makes two more logits-sized tensors: on the 125m preset, batch 2 x 128, about
    60 MiB more at the output layer's backward, a lean method's peak.)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                comm: Comm | None, vocab_start: int) -> torch.Tensor:
        lf = logits.float()
        # a shift for stability; any value works as long as all y-ranks use the same one
        shift = lf.detach().amax(-1)
        if comm is not None:
            shift = comm.all_reduce(shift, "y", op="max").wait()
        local = targets - vocab_start
        owned = (local >= 0) & (local < lf.shape[-1])
        local = local.masked_fill(~owned, 0)
        target_logit = (lf.gather(-1, local.unsqueeze(-1)).squeeze(-1) - shift) * owned
        keep = ctx.needs_input_grad[0]
        if keep:  # the softmax is the backward's: one logits-sized tensor, exp'd in place
            exp = (lf - shift.unsqueeze(-1)).exp_()
            local_sum = exp.sum(-1)
        else:  # no backward (evaluation, MeZO / ES): the sums row block by row block
            local_sum = _sum_exp_by_rows(lf, shift)
        sum_exp = local_sum
        if comm is not None:
            stats = comm.all_reduce(torch.stack([local_sum, target_logit]), "y").wait()
            sum_exp, target_logit = stats[0], stats[1]
        loss = torch.log(sum_exp) - target_logit
        if keep:
            exp.div_(sum_exp.unsqueeze(-1))  # softmax over the local slice
            ctx.save_for_backward(exp, local, owned)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        softmax, local, owned = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, local.unsqueeze(-1), -owned.to(g.dtype).unsqueeze(-1))
        g.mul_(grad.unsqueeze(-1))
        return g.to(ctx.logits_dtype), None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Per-token cross-entropy (b, T) from logits split over y (b, T, V/Gy)."""

    def __init__(self, comm: Comm, vocab_start: int) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_start = vocab_start

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _SoftmaxCrossEntropy.apply(logits, targets, self.comm, self.vocab_start)


class CrossEntropy(nn.Module):
    """Per-token cross-entropy, unreduced: (B, T) losses from whole logits (B, T, V). The
    loss of a model whose output layer is not split; VocabParallelCrossEntropy replaces it
    when the vocabulary is split over y. It is VocabParallelCrossEntropy's Function without
    the reductions (for a backward, one logits-sized tensor kept, not F.cross_entropy's
    three)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # without a backward the Function sums by row blocks (NO_GRAD_LOSS_BLOCK_ELEMENTS)
        return _SoftmaxCrossEntropy.apply(logits, targets, None, 0)


# ---- the output layer and the loss a block of vocabulary at a time ------------------------

# columns of logits (vocabulary entries) per block of the blocked loss: about
# NO_GRAD_LOSS_BLOCK_ELEMENTS logits, and at least this many columns (narrower GEMMs run far
# below a GPU's peak)
OUTPUT_LOSS_MIN_COLUMNS = 1024
def output_loss_columns(tokens: int) -> int:
    """Vocabulary columns per block of the blocked output layer and loss, for `tokens` rows."""
    return max(OUTPUT_LOSS_MIN_COLUMNS, NO_GRAD_LOSS_BLOCK_ELEMENTS // max(1, tokens))


def uses_blocked_loss(mode: str, preferred: bool = False) -> bool:
    """parallel.output_loss: "blocks", or "auto" where the caller `preferred` the blocked loss
    (a training method whose peak holds the logits: a backward that starts at the output layer
    with little else alive, or a forward without backward). Its price: making the logits again
    in backward, one more GEMM of the output layer, and where x > 1 one more all-reduce of the
    logits over x (a forward without backward pays neither); where the peak is elsewhere (the
    gradients and moments of AdamW) it saves nothing."""
    return mode == "blocks" or (mode == "auto" and preferred)


def resolve_output_loss(mode: str, preferred: bool) -> str:
    """parallel.output_loss as a run uses it, blocks or whole (`preferred` as
    uses_blocked_loss takes it)."""
    return "blocks" if uses_blocked_loss(mode, preferred) else "whole"


def _block_space(rows: torch.Tensor, vocab: int, dtype: torch.dtype,
                 engine: Engine | None) -> torch.Tensor | None:
    """One block's worth of float32 logits that every block of a pass is written into, or None
    where blocks are made one by one (a compute dtype other than float32, or tuned GEMMs,
    whose variants make their own). On a host a fresh block per GEMM is a fresh malloc: where
    the output layer's input is split (x > 1) gloo's worker thread frees the block it summed a
    moment after the next one is made, so two blocks' bytes take turns at the heap's top and
    the heap grows by up to a block each time the race goes that way."""
    if dtype != torch.float32 or (engine is not None and engine.tuner is not None):
        return None
    n = rows.shape[0]
    return torch.empty(n * min(vocab, output_loss_columns(n)), dtype=dtype, device=rows.device)


def _block_logits(rows: torch.Tensor, w: torch.Tensor, output: nn.Module,
                  space: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits of rows against a block of the output layer's rows (summed over the
    layer's input axis); written into the front of `space` where given (_block_space)."""
    if space is not None:
        out = torch.matmul(rows, w.t(), out=space[:rows.shape[0] * w.shape[0]].view(
            rows.shape[0], w.shape[0]))
        if isinstance(output, Linear3D):  # summed in place (float32 goes on the wire as is)
            out = output.engine.comm.all_reduce(out, output.in_axis).wait()
        return out
    if isinstance(output, Linear3D):
        engine = output.engine
        return engine.comm.all_reduce(engine.matmul("forward", rows, w),
                                      output.in_axis).wait().float()
    return torch.matmul(rows, w.t()).float()


class _OutputCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of h W^T, a block of the vocabulary at a time: neither pass
    holds logits-sized tensors. Forward sums each row's exponentials block by block (a running
    maximum rescales the sum, as in an online softmax) and keeps h in the compute dtype (as
    the output layer would) and each row's log-sum-exp; backward makes each block's logits again (one
    more GEMM, and one more all-reduce over x where the output layer's input is split over it),
    turns them into their gradient in place, writes that block's rows of dW and adds its share
    of dh. With a comm, the rows of W are this y-rank's vocabulary slice from vocab_start and
    the row statistics are reduced over y once."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                targets: torch.Tensor, output: nn.Module, comm: Comm | None,
                vocab_start: int) -> torch.Tensor:
        engine: Engine | None = getattr(output, "engine", None)
        dtype = compute_dtype(h)
        with torch.autocast(h.device.type, enabled=False):
            w = (engine.gather_weight(output, "forward", dtype) if engine is not None
                 else weight).to(dtype)
            rows = h.reshape(-1, h.shape[-1]).to(dtype)
            n, vocab = rows.shape[0], w.shape[0]
            local = targets.reshape(-1) - vocab_start
            owned = (local >= 0) & (local < vocab)
            local = local.masked_fill(~owned, 0)
            peak = torch.full((n,), -math.inf, dtype=torch.float32, device=h.device)
            sum_exp = torch.zeros(n, dtype=torch.float32, device=h.device)
            target = torch.zeros(n, dtype=torch.float32, device=h.device)
            step = output_loss_columns(n)
            space = _block_space(rows, vocab, dtype, engine)
            for a in range(0, vocab, step):
                lf = _block_logits(rows, w[a:a + step], output, space)  # (n, columns)
                here = owned & (local >= a) & (local < a + lf.shape[1])
                index = (local - a).clamp_(0, lf.shape[1] - 1).unsqueeze(-1)
                target += lf.gather(-1, index).squeeze(-1) * here
                new_peak = torch.maximum(peak, lf.amax(-1))
                sum_exp.mul_(torch.exp(peak - new_peak))
                sum_exp += lf.sub_(new_peak.unsqueeze(-1)).exp_().sum(-1)
                peak = new_peak
                del lf
            if comm is not None:
                top = comm.all_reduce(peak.clone(), "y", op="max").wait()
                sum_exp.mul_(torch.exp(peak - top))
                stats = comm.all_reduce(torch.stack([sum_exp, target]), "y").wait()
                sum_exp, target, peak = stats[0], stats[1], top
            lse = peak + torch.log(sum_exp)
            loss = lse - target
        ctx.output, ctx.dtype = output, dtype
        ctx.kept_block = None
        if engine is not None and engine.is_last(output) and engine.comm.grid.size("z") > 1 \
                and keeps_output_block(w.numel() * w.element_size(),
                                       n * vocab * w.element_size(), n * vocab):
            ctx.kept_block = w  # the same rule as the output layer's own (Linear3D)
        # h is kept as the GEMMs read it, in the compute dtype (rows, a view of h in float32)
        ctx.h_shape, ctx.h_dtype = h.shape, h.dtype
        ctx.save_for_backward(rows, weight if engine is None else None, lse, local, owned)
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        rows, weight, lse, local, owned = ctx.saved_tensors
        output: nn.Module = ctx.output
        engine: Engine | None = getattr(output, "engine", None)
        dtype = ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(grad.device.type, enabled=False):
            # gathered even for a frozen weight: the engine's prefetch order expects it
            w = (engine.gather_weight(output, "backward", dtype, kept=ctx.kept_block)
                 if engine is not None else weight).to(dtype)
            ctx.kept_block = None
            n, vocab = rows.shape[0], w.shape[0]
            g = grad.reshape(-1, 1).float()
            # dh sums over the blocks (float32); partial over y where the vocabulary is split
            # there, which the fan-out that made h sums
            grad_h = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device) \
                if need_h else None
            dw = None
            if need_w:
                # on one process dW is the gradient that autograd takes: made in the weight's
                # dtype, each block's product cast as it is written, no whole dW in the
                # compute dtype beside its cast. (On a grid, in the compute dtype: made in
                # float32 it raised a 2 x 2 LOMO rank's bfloat16 heap peak from about 52 to 55
                # MB, small preset, 2 x 512 tokens: the engine's released buffer then lasts
                # through the forward.)
                dw = (engine.grad_buffer(tuple(w.shape), dtype, rows.device) if engine is not None
                      else torch.empty(w.shape, dtype=weight.dtype, device=rows.device))
            step = output_loss_columns(n)
            space = _block_space(rows, vocab, dtype, engine)
            for a in range(0, vocab, step):
                wb = w[a:a + step]
                d = _block_logits(rows, wb, output, space)
                d.sub_(lse.unsqueeze(-1)).exp_()  # the softmax's block
                here = owned & (local >= a) & (local < a + d.shape[1])
                index = (local - a).clamp_(0, d.shape[1] - 1).unsqueeze(-1)
                d.scatter_add_(-1, index, -here.to(d.dtype).unsqueeze(-1))
                d = d.mul_(g).to(dtype)
                if grad_h is not None:
                    if dtype == torch.float32:
                        grad_h.addmm_(d, wb)
                    else:
                        grad_h += torch.matmul(d, wb)
                if dw is not None and dw.dtype == d.dtype:
                    torch.matmul(d.t(), rows, out=dw[a:a + step])  # rows of dW: contiguous
                elif dw is not None:
                    dw[a:a + step] = torch.matmul(d.t(), rows)
                del d
        grad_h = grad_h.to(ctx.h_dtype).view(ctx.h_shape) if grad_h is not None else None
        if engine is None:
            return grad_h, dw, None, None, None, None  # dw: in the weight's dtype already
        if dw is not None:
            if engine.comm.grid.size("z") == 1:  # no reduce-scatter to start under dh's sum:
                engine.reduce_scatter_weight_grad(output.weight, dw)  # final now, handed on
            else:
                engine.defer(lambda: engine.reduce_scatter_weight_grad(output.weight, dw))
        return grad_h, None, None, None, None, None


def blocked_loss_applies(output: nn.Module) -> bool:
    """Whether the blocked loss can stand in for `output` and the loss: a plain Linear or a
    Linear3D (not one of a fused group), without a bias and without hooks on its forward (a
    LoRA adapter adds its term by one, which the blocked loss would not run)."""
    if output._forward_hooks or output._forward_pre_hooks:
        return False
    if type(output) is nn.Linear:
        return output.bias is None
    return type(output) is Linear3D and output.bias is None and output.fused is None \
        and not output.transposed


class BlockedOutputLoss(nn.Module):
    """Per-token losses (b, T) from the last hidden states and the output layer, a block of
    the vocabulary at a time (parallel.output_loss, see uses_blocked_loss): with `comm`, the
    output layer's rows are this y-rank's vocabulary slice from `vocab_start`. An output layer
    it cannot take (blocked_loss_applies) gets `whole`, the loss over its whole logits."""

    def __init__(self, comm: Comm | None, vocab_start: int, whole: nn.Module) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_start = vocab_start
        self.whole = whole  # the loss over whole logits, for an output layer this cannot take

    def forward(self, h: torch.Tensor, output: nn.Module, targets: torch.Tensor) -> torch.Tensor:
        if not blocked_loss_applies(output):  # e.g. wrapped by an adapter since
            return self.whole(output(h), targets)
        return _OutputCrossEntropy.apply(h, output.weight, targets, output, self.comm,
                                         self.vocab_start)
