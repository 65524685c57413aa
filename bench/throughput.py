"""Training throughput on this machine: fourfold vs a plain PyTorch loop vs HF transformers.

The same model shapes are trained three ways, in float32 and in bfloat16 (autocast):

- fourfold: fourfold's own Trainer.train_step (parallel engine on a one-process grid,
  fourfold's AdamW setup, loss normalization and gradient clipping), on the built-in corpus;
- plain:    a nanoGPT-style loop written here: its own small Llama (RMSNorm, RoPE, SwiGLU, SDPA
            attention), fused AdamW, clipping; random tokens;
- hf:       transformers' LlamaForCausalLM (SDPA attention) with the same shapes and the same
            loop as plain; random tokens;
- fourfold+compile (not in the default set: compiling takes minutes on a CPU): fourfold with
            train.compile = true (each transformer block compiled by torch.compile);
- fourfold+gemm (not in the default set): fourfold with parallel.gemm_tuning = true (each
            linear's GEMMs tuned once per shape: matmul layouts, and oneDNN beside MKL);
- fourfold+compile+gemm (not in the default set): both;
- fourfold+blocks (not in the default set): fourfold with parallel.output_loss = "blocks"
            (the output layer and the loss a block of the vocabulary at a time, the logits
            made again in backward: what "auto" gives the memory-lean methods; AdamW's
            default keeps whole logits);
- plain+compile (not in the default set): the plain loop with its model under torch.compile.

Each runs in its own process, as its user would run it: fourfold's Trainer tunes malloc for
its process on CPU (fourfold.train.host_memory: freed memory is kept for reuse instead of being
returned to the kernel and zero-filled again on the next step); the plain and HF loops run with
glibc's defaults unless --same-malloc gives them the same tuning (a comparison of the models and
loops alone).

Each row runs warmup steps, then times steps (the ways take turns, with a pause between turns;
each keeps its fastest step). MFU = flops_per_token(model, seq) * tokens/s / peak, where peak
is the best matmul FLOP/s that probes of this machine in that dtype reached over the whole run
(at the start and after every timed round), so MFU is relative to what this CPU's matmul
reaches, not to a datasheet number.

    python bench/throughput.py                      # both shapes, both dtypes, all three ways
    python bench/throughput.py --shapes 15m --dtypes float32 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, header  # noqa: E402
from common import parser as bench_parser  # noqa: E402

from fourfold.config import ModelConfig, load_config, model_config
from fourfold.models.llama import flops_per_token
from fourfold.train.host_memory import keep_freed_host_memory
from fourfold.train.metrics import measure_matmul_flops

# name -> (model config, sequence length, sequences per step)
SHAPES: dict[str, tuple[ModelConfig, int, int]] = {
    "15m": (model_config("15m"), 256, 8),
    # ~35M parameters counted as flops_per_token does (layers + output layer; the embedding
    # lookup is free): 6 layers, width 512, 8 heads, SwiGLU hidden 1376 (about 8/3 * 512).
    "35m": (model_config("15m", n_layers=6, dim=512, n_heads=8, n_kv_heads=8, ffn_dim=1376,
                         vocab_size=32000, max_seq_len=512), 512, 2),
}
IMPLEMENTATIONS = ("fourfold", "fourfold+compile", "fourfold+gemm", "fourfold+compile+gemm",
                   "fourfold+blocks", "plain", "plain+compile", "hf")
DEFAULT_IMPLEMENTATIONS = ("fourfold", "plain", "hf")
DTYPES = ("float32", "bfloat16")
LR = 3e-4
# A pause before each turn (--turn-gap): work that lingers after a process's step (its OpenMP
# threads spinning, the kernel taking back freed memory) otherwise slows the next process's
# step. Measured on the 35m float32 row: fourfold alone 1.44 s/step; taking turns with
# --turn-gap 0, 1.63 s; with 0.3 s, 1.45 s.
TURN_GAP_S = 0.3


# --------------------------------------------------------------------------------------------
# The plain PyTorch model, nanoGPT style


class PlainRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class PlainBlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.dim // c.n_heads
        self.ln1 = PlainRMSNorm(c.dim, c.norm_eps)
        self.qkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * self.hd, bias=False)
        self.proj = nn.Linear(c.dim, c.dim, bias=False)
        self.ln2 = PlainRMSNorm(c.dim, c.norm_eps)
        self.gate_up = nn.Linear(c.dim, 2 * c.ffn_dim, bias=False)
        self.down = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(
            [self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(B, T, self.n_head, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv != self.n_head)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        gate, up = self.gate_up(self.ln2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainLlama(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.blocks = nn.ModuleList(PlainBlock(c) for _ in range(c.n_layers))
        self.norm = PlainRMSNorm(c.dim, c.norm_eps)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        hd = c.dim // c.n_heads
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(c.max_seq_len).float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.cos[:T], self.sin[:T])
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def hf_llama(c: ModelConfig) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fourfold.models.hf import config_to_hf

    config = LlamaConfig(**{k: v for k, v in config_to_hf(c).items()
                            if k not in ("architectures", "torch_dtype")})
    return LlamaForCausalLM(config)


# --------------------------------------------------------------------------------------------
# Timing


@dataclass
class Row:
    shape: str
    dtype: str
    impl: str
    params: int
    tokens_per_step: int
    seconds_per_step: float
    tokens_per_s: float
    mfu: float


def measure_peak_flops(dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Best achieved FLOP/s of square matmuls in `dtype` on this CPU (current thread count):
    the trainer's probe, at three sizes."""
    cpu = torch.device("cpu")
    return max(measure_matmul_flops(cpu, dtype, seconds / 3, size=n) for n in (512, 1024, 2048))


def autocast(dtype: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(model.parameters(), lr=LR)


def simple_loop(model: nn.Module, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                vocab: int, batch: int, seq: int, dtype: str) -> Callable[[], None]:
    optimizer = make_optimizer(model)
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        data = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        x, y = data[:, :-1], data[:, 1:]
        with autocast(dtype):
            loss = loss_of(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_step(impl: str, c: ModelConfig, seq: int, batch: int, dtype: str,
               run_dir: str) -> tuple[Callable[[], None], int]:
    """A function that runs one training step, and the model's parameter count."""
    torch.manual_seed(0)
    if impl.startswith("fourfold"):
        from fourfold.train.trainer import Trainer

        model_keys = [f"model.{f.name}={getattr(c, f.name)}" for f in fields(c)
                      if f.name != "preset"]
        cfg = load_config(None, ["model.preset=custom", *model_keys,
                                 f"train.seq_len={seq}", f"train.batch_size={batch}",
                                 f"train.dtype={dtype}", "train.device=cpu",
                                 f"train.lr={LR}", "train.warmup_steps=0",
                                 "data.path=builtin:stdlib", "data.tokenizer=byte",
                                 f"train.compile={'+compile' in impl}",
                                 f"parallel.gemm_tuning={'+gemm' in impl}",
                                 "parallel.output_loss="
                                 + ("blocks" if "+blocks" in impl else "auto")])
        trainer = Trainer(cfg, run_dir, progress=False)
        return (lambda: trainer.train_step() and None), trainer.pmodel.module.num_params()
    if impl in ("plain", "plain+compile"):
        model = PlainLlama(c)
        loss_of = torch.compile(model) if impl == "plain+compile" else model
        return (simple_loop(model, loss_of, c.vocab_size, batch, seq, dtype),
                sum(p.numel() for p in model.parameters()))
    if impl == "hf":
        model = hf_llama(c)
        model.train()

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=x).logits
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

        return (simple_loop(model, loss_of, c.vocab_size, batch, seq, dtype),
                sum(p.numel() for p in model.parameters()))
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")


def _worker(conn: Connection, impl: str, shape: str, dtype: str, run_dir: str,
            same_malloc: bool) -> None:
    """One implementation in its own process: build it, then run a step whenever asked."""
    if same_malloc:
        keep_freed_host_memory()
    c, seq, batch = SHAPES[shape]
    step, params = build_step(impl, c, seq, batch, dtype, run_dir)
    conn.send(params)
    while conn.recv() == "step":
        t0 = time.perf_counter()
        step()
        conn.send(time.perf_counter() - t0)


def run(shapes: list[str], dtypes: list[str], impls: list[str], warmup: int,
        steps: int, same_malloc: bool = False,
        turn_gap_s: float = TURN_GAP_S) -> tuple[list[Row], dict[str, float]]:
    """Time every implementation on every shape and dtype.

    Each implementation runs in its own process, as its user would run it (so fourfold's
    malloc tuning helps fourfold alone unless `same_malloc`). The processes take turns step by
    step, one computing at a time, and each keeps its fastest step, so that load from other
    processes on a shared machine does not favour whichever ran at a quiet moment. The matmul
    peak is probed in the same way: at the start and again after every timed round, keeping
    the best, so MFU's numerator and denominator are both best-of figures from the same span."""
    torch_dtype = {d: torch.bfloat16 if d == "bfloat16" else torch.float32 for d in dtypes}
    peaks = {d: measure_peak_flops(torch_dtype[d]) for d in dtypes}
    timed: list[tuple[str, str, str, int, float]] = []
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            c, seq, batch = SHAPES[shape]
            tokens = batch * seq
            for dtype in dtypes:
                workers: dict[str, tuple[Connection, BaseProcess, int]] = {}
                try:
                    for impl in impls:  # built one after another: building is work too
                        conn, child = ctx.Pipe()
                        proc = ctx.Process(target=_worker, daemon=True, args=(
                            child, impl, shape, dtype, f"{tmp}/{shape}-{impl}", same_malloc))
                        proc.start()
                        workers[impl] = (conn, proc, conn.recv())
                    best = {impl: math.inf for impl in impls}
                    for i in range(warmup + steps):
                        for impl, (conn, _, _) in workers.items():
                            time.sleep(turn_gap_s)
                            conn.send("step")
                            seconds = conn.recv()
                            if i >= warmup:
                                best[impl] = min(best[impl], seconds)
                        if i >= warmup:
                            peaks[dtype] = max(peaks[dtype],
                                               measure_peak_flops(torch_dtype[dtype], 0.3))
                finally:
                    for conn, proc, _ in workers.values():
                        conn.send("stop")
                        proc.join(timeout=60)
                for impl in impls:
                    timed.append((shape, dtype, impl, workers[impl][2], best[impl]))
                    print(f"  {shape:>4} {dtype:>8} {impl:>21}: {tokens / best[impl]:9,.0f} "
                          "tok/s", flush=True)
    rows = []
    for shape, dtype, impl, params, seconds in timed:
        c, seq, batch = SHAPES[shape]
        tps = batch * seq / seconds
        rows.append(Row(shape, dtype, impl, params, batch * seq, seconds, tps,
                        flops_per_token(c, seq) * tps / peaks[dtype]))
    return rows, peaks


def print_table(rows: list[Row], peaks: dict[str, float]) -> None:
    """The rows, with each one's tokens/s as a multiple of the plain loop's on its shape and
    dtype (when plain ran)."""
    plain = {(r.shape, r.dtype): r.tokens_per_s for r in rows if r.impl == "plain"}
    print("\npeak (this host's best matmul): " + ", ".join(
        f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in peaks.items())
        + f"; {torch.get_num_threads()} threads\n")
    table = Table("shape", "dtype", "implementation", "parameters", "tokens per step",
                  "best s per step", "tokens/s", "vs plain", "MFU")
    for r in rows:
        ratio = plain.get((r.shape, r.dtype))
        table.row(r.shape, r.dtype, r.impl, f"{r.params / 1e6:.1f}M", r.tokens_per_step,
                  f"{r.seconds_per_step:.2f}", f"{r.tokens_per_s:,.0f}",
                  f"{r.tokens_per_s / ratio:.2f}" if ratio else "-", f"{100 * r.mfu:.1f}%")


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{what} {value!r}: choose from {', '.join(allowed)}")
    return items


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--shapes", default="15m,35m",
                        type=lambda v: _csv(v, tuple(SHAPES), "--shapes"))
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        type=lambda v: _csv(v, DTYPES, "--dtypes"))
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLEMENTATIONS),
                        type=lambda v: _csv(v, IMPLEMENTATIONS, "--impls"))
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--same-malloc", action="store_true",
                        help="give the plain and HF loops fourfold's malloc tuning too")
    parser.add_argument("--turn-gap", type=float, default=TURN_GAP_S, metavar="SECONDS",
                        help=f"pause before each turn (default {TURN_GAP_S})")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.turn_gap < 0:
        parser.error("--steps must be at least 1, --warmup and --turn-gap not negative")
    header("Training throughput: fourfold against a plain PyTorch loop and HF transformers",
           f"one process; {args.warmup} untimed and {args.steps} timed steps per row, the "
           "implementations taking turns; each row its fastest step")
    rows, peaks = run(args.shapes, args.dtypes, args.impls, args.warmup, args.steps,
                      args.same_malloc, args.turn_gap)
    print_table(rows, peaks)


if __name__ == "__main__":
    main()
