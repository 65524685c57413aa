"""A Llama-family decoder you can read in one sitting: RMSNorm, RoPE, SwiGLU, grouped-query
attention, optional tied embeddings and biases.

Head counts are read from tensor shapes, not from the config, so that the same forward runs
unchanged after `fourfold.parallelize` has split the heads of q/k/v over a grid axis. The
output layer and the loss are separate modules (`output`, `criterion`) for the same reason:
parallelize swaps them for vocabulary-parallel versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fourfold.config import ModelConfig
from fourfold.models.attention import PackedDocuments, packed_attention
from fourfold.models.init import normal_block
from fourfold.models.recompute import recompute_in_backward
from fourfold.parallel.embedding import CrossEntropy
from fourfold.parallel.linear import compute_dtype, holds_result
from fourfold.parallel.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # w * x / sqrt(mean(x^2) + eps), keeping x (not the normalized x) for backward
        return rms_norm(x, self.weight, self.eps)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim/2,), float64 on the CPU, stretched as
    cfg.rope_scaling says, by the formulas of Hugging Face transformers' rope_type of that
    name: "linear" divides every frequency by rope_factor; "llama3" divides those whose
    wavelength exceeds rope_original_max_seq_len / rope_low_freq_factor by rope_factor, keeps
    those shorter than rope_original_max_seq_len / rope_high_freq_factor, and blends the ones
    between."""
    head_dim = cfg.head_dim
    # on the CPU even inside a meta-device build: buffers are small and computed, not drawn
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                                       device=cpu) / head_dim))
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling == "llama3":
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        context = cfg.rope_original_max_seq_len
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        between = (wavelength >= context / high) & (wavelength <= context / low)
        return torch.where(between, blended, scaled)
    return inv_freq


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (max_seq_len, head_dim) in the rotate-half layout that HF uses, with
    the sign of rotate-half folded into sin: sin's first half is negated."""
    head_dim = cfg.head_dim
    cpu = torch.device("cpu")
    t = torch.arange(cfg.max_seq_len, dtype=torch.float64, device=cpu)
    freqs = torch.outer(t, rope_frequencies(cfg))  # (T, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, head_dim)
    sign = torch.cat([-torch.ones(head_dim // 2, device=cpu),
                      torch.ones(head_dim // 2, device=cpu)]).double()
    return emb.cos().float(), (emb.sin() * sign).float()


class _Rope(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin (sin signed, see rope_tables) into one new tensor,
    written half by half in place: autograd's chain of the expression made three x-sized
    temporaries besides its output (the swapped halves and both products), freed before the
    block's next tensors, so that in a forward that keeps activations each of them left a
    hole in a CPU process's heap that no later tensor of that size fits (glibc's aligned
    allocation asks for a little more than the block it frees). Saves nothing beyond the
    tables; the backward is the transposed rotation, again one tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor,  # type: ignore[override]
                sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _rotate(x, cos, sin, transpose=False).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, transpose=True).to(ctx.x_dtype), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            transpose: bool) -> torch.Tensor:
    """x * cos + swap(x) * sin, where swap exchanges the halves of the last dimension; with
    `transpose`, its transpose x * cos + swap(x * sin) (the rotation's backward)."""
    h = x.shape[-1] // 2
    out = x * cos
    lo, hi = out[..., :h], out[..., h:]
    if transpose:
        lo.addcmul_(x[..., h:], sin[..., h:])
        hi.addcmul_(x[..., :h], sin[..., :h])
    else:
        lo.addcmul_(x[..., h:], sin[..., :h])
        hi.addcmul_(x[..., :h], sin[..., h:])
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, n_head, T, head_dim); cos/sin: (T, head_dim), sin signed (see rope_tables): HF's
    # rotate_half(x) = cat(-x2, x1) is the halves swapped times that sign
    return _Rope.apply(x, cos, sin)


@dataclass
class KVCache:
    """Keys and values of earlier positions, one (k, v) pair per layer, for generation."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]

    @classmethod
    def empty(cls, n_layers: int) -> "KVCache":
        return cls([None] * n_layers, [None] * n_layers)

    @property
    def length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[2]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0,
                documents: PackedDocuments | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        if documents is not None:  # packed rows: cos and sin are per position (B * T, 1, hd)
            q = self.q_proj(x).view(B * T, -1, self.head_dim)  # (B * T, n_head, hd)
            k = self.k_proj(x).view(B * T, -1, self.head_dim)  # (B * T, n_kv, hd)
            v = self.v_proj(x).view(B * T, -1, self.head_dim)  # (B * T, n_kv, hd)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            y = packed_attention(q, k, v, documents)  # (B * T, n_head, hd)
            return self.o_proj(y.reshape(B, T, -1))
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_head, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        causal = True
        if cache is not None:
            if cache.keys[layer] is not None:
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
                causal = T > 1  # a single new token attends to everything before it
            cache.keys[layer], cache.values[layer] = k, v
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # grouped-query attention: each kv head serves n_rep query heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        if causal and k.shape[2] != T:  # prefill after a cached prefix
            past = k.shape[2] - T
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_head * hd)
        return self.o_proj(y)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's value; the one expression its forward and any recomputation of it use, so a
    recomputed value is the forward's bit for bit. The product is written into silu's output
    (the same bits as `silu(gate) * up`): one ffn-wide temporary less (see _Rope)."""
    s = F.silu(gate)
    if holds_result(s, up):
        return s.mul_(up)
    return s * up


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up for backward and recomputing silu(gate) there:
    autograd would keep silu's output as well (a fourth ffn-wide tensor per block beside gate,
    up and down's input: 13% of a 350m block's saved activations). The gradients are autograd's
    own formulas (silu's derivative as torch's silu_backward writes it)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return silu_mul(gate, up)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        # (dy * up) * (sig * (1 + gate * (1 - sig))) with the bracket built in one tensor in
        # place (the same products, so the same bits): at most four ffn-wide temporaries
        # beside gate and up (dy, d_up, the bracket, dy * up), where the expression made seven
        gate, up = ctx.saved_tensors
        d_up = dy * F.silu(gate) if ctx.needs_input_grad[1] else None
        d_gate = None
        if ctx.needs_input_grad[0]:
            sig = torch.sigmoid(gate)
            bracket = torch.rsub(sig, 1).mul_(gate).add_(1).mul_(sig)
            del sig
            d_gate = torch.mul(dy, up).mul_(bracket)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


class _RecomputedInputLinear(torch.autograd.Function):
    """F.linear(silu(gate) * up, weight, bias) that keeps gate and up (SwiGLU keeps them
    anyway) instead of its input, and recomputes the input for the weight gradient. The GEMMs
    run in the compute dtype (autocast's, when on), the gradients return in their tensors'."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(h)
        with torch.autocast(h.device.type, enabled=False):
            y = F.linear(h.to(dtype), weight.to(dtype),
                         None if bias is None else bias.to(dtype))
        ctx.dtype, ctx.h_dtype, ctx.has_bias = dtype, h.dtype, bias is not None
        ctx.save_for_backward(weight, gate, up)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        weight, gate, up = ctx.saved_tensors
        dtype = ctx.dtype
        dy = dy.to(dtype)
        d_h = d_w = d_b = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                d_h = (dy @ weight.to(dtype)).to(ctx.h_dtype)
            flat = dy.reshape(-1, dy.shape[-1])
            if ctx.needs_input_grad[1]:
                h = silu_mul(gate, up).to(dtype)
                d_w = (flat.T @ h.reshape(-1, h.shape[-1])).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                d_b = flat.sum(0).to(weight.dtype)
        return d_h, d_w, d_b, None, None


def down_projection(down: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up), keeping one ffn-wide tensor less for backward where `down` can
    recompute its input: a plain nn.Linear with no hooks (here), or fourfold's parallel linear
    (its `recompute`). Anything else (a hooked or wrapped layer) gets the plain call."""
    h = swiglu(gate, up)
    weight = getattr(down, "weight", None)
    if not torch.is_grad_enabled() or weight is None or not weight.requires_grad:
        return down(h)
    if getattr(down, "recomputes_input", False):
        return down(h, recompute=(silu_mul, (gate, up)))
    if type(down) is nn.Linear and not (down._forward_hooks or down._forward_pre_hooks):
        return _RecomputedInputLinear.apply(h, down.weight, down.bias, gate, up)
    return down(h)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return down_projection(self.down_proj, self.gate_proj(x), self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0,
                documents: PackedDocuments | None = None) -> torch.Tensor:
        x = residual_add(x, self.attn(self.attn_norm(x), cos, sin, cache, layer, documents))
        return residual_add(x, self.ffn(self.ffn_norm(x)))


def residual_add(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """x + branch, written into `branch` where that gives the same tensor (its dtype and shape,
    and nothing saved it for backward: autograd's version check refuses the step otherwise),
    so that the branch's output is not one more freed x-sized block per residual add (see
    _Rope)."""
    if (holds_result(branch, x) and branch._base is None
            and not (branch.is_leaf and branch.requires_grad)
            and branch.untyped_storage() is not x.untyped_storage()):
        return branch.add_(x)
    return x + branch


class Llama(nn.Module):
    """The decoder. Its initial weights are a function of `seed` (when None, drawn from
    torch's global generator, except on the meta device): see `initial_block`. Built on the
    meta device (`build_model(..., device="meta")`) it allocates nothing, and `parallelize`
    materialises each rank's shards."""

    def __init__(self, cfg: ModelConfig, seed: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.embed.weight
        self.criterion = CrossEntropy()
        # set by parallelize (parallel.output_loss): the output layer and the loss together,
        # a block of the vocabulary at a time, never whole logits
        self.output_loss: nn.Module | None = None
        self.activation_checkpointing = False
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.embed.weight.is_meta:
            if self.seed is None:  # torch.manual_seed still makes the build reproducible
                self.seed = int(torch.randint(0, 2**62, (), device="cpu"))
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Set every parameter to its initial value (whole tensors; see initial_block)."""
        for name, p in self.named_parameters():
            p.copy_(self.initial_block(name, tuple(p.shape),
                                       tuple(slice(0, n) for n in p.shape)))

    def initial_block(self, name: str, full_shape: tuple[int, ...],
                      index: tuple[slice, ...]) -> torch.Tensor:
        """Block `index` of the initial value of parameter `name` (full shape `full_shape`), on
        the CPU, in float32. Defined tile by tile from (seed, name), so a block costs only the
        tiles it covers and equals the same block of the whole tensor on any grid."""
        if self.seed is None:
            raise ValueError("a model built on the meta device without a seed has no initial "
                             "values; build it with build_model(cfg, seed=..., device=\"meta\")")
        shape = tuple(s.stop - s.start for s in index)
        std = self.cfg.init_std
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if name == "output.weight" and self.cfg.tie_embeddings:
            name = "embed.weight"
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = std / math.sqrt(2 * self.cfg.n_layers)  # residual projections (GPT-2)
        return normal_block(self.seed, name, full_shape, index, std)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.embed.weight.numel()
        return n

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or per-token losses (B, T) when targets are given.

        `documents` (B, T): the document of each position of packed rows, numbered in each row
        (a loader batch's `documents`, on the host): attention stays inside each document and
        positions restart at each (models/attention.py)."""
        B, T = tokens.shape
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens is longer than max_seq_len "
                             f"{self.cfg.max_seq_len}")
        packed = None
        if documents is not None:
            if cache is not None:
                raise ValueError("packed documents and a KV cache do not go together")
            packed = PackedDocuments.from_ids(documents, tokens.device)
            if packed.one_per_row:  # plain causal rows: the unpacked path is the same
                packed = None
        if packed is not None:
            cos, sin = packed.rope(self.rope_cos, self.rope_sin)  # (B * T, 1, hd)
        else:
            cos = self.rope_cos[start:start + T]
            sin = self.rope_sin[start:start + T]
        h = self.embed(tokens)  # (B, T, dim)
        for i, layer in enumerate(self.layers):
            if self.activation_checkpointing and self.training and cache is None:
                h = recompute_in_backward(layer, h, cos, sin, None, i, packed)
            else:
                h = layer(h, cos, sin, cache, i, packed)
        h = self.norm(h)
        if targets is not None and self.output_loss is not None:
            return self.output_loss(h, self.output, targets)
        logits = self.output(h)  # (B, T, vocab)
        if targets is None:
            return logits
        return self.criterion(logits, targets)


def build_model(cfg: ModelConfig, seed: int | None = None,
                device: torch.device | str | None = None) -> Llama:
    """A freshly initialized model; with a seed, the same weights on every process (and on
    every grid). With device="meta" nothing is allocated: `parallelize` then materialises and
    initialises only each rank's own shards, to the same values."""
    if device is None:
        return Llama(cfg, seed)
    with torch.device(device), _NoDefaultInitOnMeta():
        return Llama(cfg, seed)


class _NoDefaultInitOnMeta(TorchFunctionMode):
    """nn.Linear's and nn.Embedding's own initialisation skipped on meta tensors (Llama sets
    every parameter itself): on the meta device it would run torch's Python meta kernels,
    whose first call imports torch._dynamo (about 70 MiB resident, a second)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight GEMMs (forward 2N, backward 4N), plus the
    attention scores and weighted sum, 12 * n_layers * dim * seq_len (PaLM appendix B).
    N counts the non-embedding parameters plus the output layer (the embedding lookup is free)."""
    d, L = cfg.dim, cfg.n_layers
    kv = cfg.n_kv_heads * cfg.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * cfg.ffn_dim
    n = L * per_layer + cfg.vocab_size * d
    return 6.0 * n + 12.0 * L * d * seq_len
