"""The Llama-family model: parity with Hugging Face transformers, the KV cache, presets."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from fourfold.config import PRESETS, model_config
from fourfold.models import KVCache, build_model, flops_per_token
from fourfold.models.hf import (config_from_hf, config_to_hf, fourfold_to_hf_name,
                                hf_to_fourfold_name, state_dict_from_hf, state_dict_to_hf)
from fourfold.models.llama import Llama


def tiny_hf(**overrides) -> tuple[LlamaForCausalLM, object]:
    cfg = model_config("debug", **overrides)
    hf_cfg = {k: v for k, v in config_to_hf(cfg).items() if k != "architectures"}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model, cfg


@pytest.mark.parametrize("overrides", [{}, {"bias": True}, {"tie_embeddings": True},
                                       {"n_kv_heads": 1, "rope_theta": 500000.0}])
def test_logits_equal_hugging_face_llama(overrides: dict) -> None:
    hf, cfg = tiny_hf(**overrides)
    ours = build_model(cfg).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff < 1e-4


def test_config_and_names_round_trip() -> None:
    cfg = model_config("debug", bias=True, tie_embeddings=True)
    back = config_from_hf(config_to_hf(cfg))
    for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                "max_seq_len", "rope_theta", "tie_embeddings", "bias"):
        assert getattr(back, key) == getattr(cfg, key), key
    model = build_model(cfg)
    for name in model.state_dict():
        assert hf_to_fourfold_name(fourfold_to_hf_name(name)) == name
    hf_state = state_dict_to_hf(model.state_dict(), cfg)
    assert "lm_head.weight" not in hf_state  # tied: HF re-ties it from the embedding
    with pytest.raises(KeyError, match="unknown Hugging Face parameter"):
        hf_to_fourfold_name("model.layers.0.self_attn.rotary.weight")


def test_kv_cache_decoding_equals_full_forward() -> None:
    cfg = model_config("debug")
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache.empty(cfg.n_layers)
        parts = [model(tokens[:, :10], cache=cache)]  # prefill
        parts += [model(tokens[:, t:t + 1], cache=cache) for t in range(10, 16)]
        parts.append(model(tokens[:, 16:], cache=cache))  # a chunk after a cached prefix
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 24


def test_sequence_longer_than_the_model_allows_is_refused() -> None:
    cfg = model_config("debug", max_seq_len=16)
    with pytest.raises(ValueError, match="longer than max_seq_len 16"):
        build_model(cfg)(torch.zeros(1, 17, dtype=torch.long))


def test_same_seed_same_weights() -> None:
    a, b = build_model(model_config("debug"), seed=5), build_model(model_config("debug"), seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


@pytest.mark.parametrize("preset,billions", [("8b", 8.03), ("70b", 70.55), ("405b", 405.85)])
def test_llama3_presets_have_llama3_sizes(preset: str, billions: float) -> None:
    with torch.device("meta"):  # no memory: shapes only
        model = Llama(model_config(preset))
    assert model.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_small_presets_build_and_debug_is_about_a_million() -> None:
    assert 0.8e6 < build_model(model_config("debug")).num_params() < 1.3e6
    for name in PRESETS:
        cfg = model_config(name)
        assert cfg.dim % cfg.n_heads == 0 and cfg.n_heads % cfg.n_kv_heads == 0, name


def test_flops_per_token_is_6n_plus_attention() -> None:
    cfg = model_config("debug")
    model = build_model(cfg)
    # N: every weight that takes part in a GEMM (the output layer too; the embedding lookup
    # and the norms do no matmul)
    n = model.num_params() - model.embed.weight.numel() - sum(
        p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert flops_per_token(cfg, 64) == 6 * n + 12 * cfg.n_layers * cfg.dim * 64


@pytest.mark.parametrize("autocast", [False, True])
def test_down_projection_recomputes_its_input_and_matches_autograd(autocast: bool) -> None:
    """FeedForward keeps gate and up for backward, not silu(gate) * up (down's input), and its
    gradients are those of the plain down_proj(swiglu(gate, up)), bit for bit (float32 and
    bfloat16 autocast); a hooked down_proj (as LoRA hooks it) takes the plain call."""
    import copy

    from fourfold.models.llama import FeedForward, swiglu

    cfg = model_config("debug", bias=True)
    torch.manual_seed(0)
    ff = FeedForward(cfg)
    ref = copy.deepcopy(ff)
    x = torch.randn(2, 8, cfg.dim, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = ff(x)
        y_ref = ref.down_proj(swiglu(ref.gate_proj(x_ref), ref.up_proj(x_ref)))
    wide = 2 * 8 * cfg.ffn_dim  # elements of an ffn-wide activation

    def ffn_wide() -> list[tuple[int, ...]]:
        return [s for s in shapes if math.prod(s) == wide]

    # gate and up, each kept by SwiGLU and by the down projection (the same storage)
    assert ffn_wide() == [(2, 8, cfg.ffn_dim)] * 4, shapes
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)
    for (name, p), q in zip(ff.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name

    hooked = copy.deepcopy(ref)
    hooked.down_proj.register_forward_hook(lambda m, i, o: o)
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hooked(x_ref)
    assert len(ffn_wide()) == 3, shapes  # gate, up and down's input


def test_loss_without_backward_works_by_row_blocks_and_equals_the_loss_with_it() -> None:
    """Evaluation and MeZO / ES take the loss a block of rows at a time (several blocks here);
    each row's loss is the one the whole-tensor loss gives, bit for bit, on one process and
    for the vocabulary-parallel sums."""
    from fourfold.parallel.embedding import (NO_GRAD_LOSS_BLOCK_ELEMENTS, CrossEntropy,
                                             _sum_exp_by_rows)

    torch.manual_seed(0)
    logits = torch.randn(4, 300, 5000)
    targets = torch.randint(0, 5000, (4, 300))
    assert logits.numel() > 3 * NO_GRAD_LOSS_BLOCK_ELEMENTS
    with_grad = CrossEntropy()(logits.clone().requires_grad_(), targets)
    with torch.no_grad():
        without = CrossEntropy()(logits, targets)
    assert torch.equal(with_grad.detach(), without)
    shift = logits.amax(-1)
    assert torch.equal(_sum_exp_by_rows(logits, shift),
                       torch.exp(logits - shift.unsqueeze(-1)).sum(-1))


@pytest.mark.slow
def test_blocked_output_loss_equals_the_loss_over_whole_logits() -> None:
    """parallel.output_loss = "blocks" (what "auto" gives the lean methods): the output
    layer and the loss a block of the vocabulary at a time (several blocks here), the logits
    made again in backward. The losses and gradients equal the whole-logits loss's to float32
    rounding (the exponentials are summed block by block), the losses without backward equal
    those with it bit for bit; an output layer with a forward
    hook (a LoRA adapter) falls back to whole logits, and an unknown mode is refused. Tied
    embeddings: the output's dW joins the embedding's (untied: tests/test_parallel.py, whose
    one-process reference takes blocks and whose x = 2 grids whole logits)."""
    from fourfold.config import ConfigError, ParallelConfig
    from fourfold.parallel import Grid, parallelize
    from fourfold.parallel.embedding import BlockedOutputLoss, CrossEntropy, output_loss_columns

    cfg = model_config("debug", vocab_size=8192, tie_embeddings=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (9, 65), generator=g)
    weights = torch.rand(9, 64, generator=g)
    assert cfg.vocab_size > 4 * output_loss_columns(9 * 64)  # several blocks, a ragged last
    runs = {}
    for mode in ("whole", "blocks"):
        model = build_model(cfg, seed=0)
        pmodel = parallelize(model, Grid.single(), ParallelConfig(output_loss=mode))
        assert isinstance(model.output_loss, BlockedOutputLoss) == (mode == "blocks")
        loss = pmodel(tokens[:, :-1], tokens[:, 1:])
        (loss * weights).sum().backward()
        with torch.no_grad():
            runs[mode] = (loss.detach(), pmodel(tokens[:, :-1], tokens[:, 1:]),
                          {n: p.grad for n, p in model.named_parameters()})
    (whole, whole_ng, whole_grads), (blocks, blocks_ng, blocks_grads) = runs["whole"], \
        runs["blocks"]
    assert (blocks - whole).abs().max() <= 1e-6 * whole.abs().max()
    assert torch.equal(whole, whole_ng) and torch.equal(blocks, blocks_ng)
    for name, grad in whole_grads.items():
        assert (blocks_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name
    # a hook on the output layer (LoRA adds its term by one): the whole-logits path runs it
    model = build_model(cfg, seed=0)
    pmodel = parallelize(model, Grid.single(), ParallelConfig(output_loss="blocks"))
    model.output.register_forward_hook(lambda module, args, out: out * 0.5)
    hooked = pmodel(tokens[:, :-1], tokens[:, 1:])
    with torch.no_grad():
        expected = CrossEntropy()(model.output(model.norm(_hidden(model, tokens[:, :-1]))),
                                  tokens[:, 1:])
    assert torch.equal(hooked.detach(), expected) and not torch.equal(hooked.detach(), blocks)
    # bfloat16 autocast: the blocks' GEMMs in bfloat16, their sums in float32, as whole
    # logits' are (their values differ by bfloat16 rounding of the logits)
    bf16 = {}
    for mode in ("whole", "blocks"):
        model = build_model(cfg, seed=0)
        pmodel = parallelize(model, Grid.single(), ParallelConfig(output_loss=mode))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pmodel(tokens[:, :-1], tokens[:, 1:])
        (loss * weights).sum().backward()
        bf16[mode] = (loss.detach().float(), model.output.weight.grad)
    assert (bf16["blocks"][0] - bf16["whole"][0]).abs().max() <= 2e-2 * whole.abs().max()
    assert (bf16["blocks"][1] - bf16["whole"][1]).abs().max() <= 2e-2 * \
        bf16["whole"][1].abs().max()
    with pytest.raises(ConfigError, match="parallel.output_loss = 'rows': choose one of "
                       "auto, blocks, whole"):
        parallelize(build_model(cfg, seed=0), Grid.single(), ParallelConfig(output_loss="rows"))


@pytest.mark.slow
def test_blocked_output_loss_writes_every_block_into_one_buffer_per_pass() -> None:
    """float32 blocks of the blocked loss are written into one block's buffer that each pass
    (forward, backward) makes once: a fresh block per GEMM is a fresh malloc on a host, and
    where gloo sums the block over x it frees each a moment late, so the heap wandered by up to
    a block each time (an ES rank on 2 x 2; tests/test_lean_optim.py checks the grids' losses).
    Under bfloat16 autocast each block is made anew (its cast to float32 makes one anyway)."""
    from fourfold.config import ParallelConfig
    from fourfold.parallel import Grid, parallelize
    from fourfold.parallel.embedding import output_loss_columns

    cfg = model_config("debug", vocab_size=8192)
    tokens = torch.randint(0, cfg.vocab_size, (9, 65), generator=torch.Generator().manual_seed(1))
    n = 9 * 64
    block_bytes = n * output_loss_columns(n) * 4
    blocks = -(-cfg.vocab_size // output_loss_columns(n))
    assert blocks >= 4

    def made(autocast: bool) -> int:
        """Storages of a float32 block's size that a blocked forward and backward make."""
        model = build_model(cfg, seed=0)
        pmodel = parallelize(model, Grid.single(), ParallelConfig(output_loss="blocks"))
        h = model.norm(_hidden(model, tokens[:, :-1])).detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                _StoragesMade(lambda nbytes: nbytes == block_bytes) as made:
            model.output_loss(h, model.output, tokens[:, 1:]).sum().backward()
        return len(made)

    assert made(autocast=False) == 2  # one buffer per pass
    assert made(autocast=True) == 2 * (blocks - 1)  # each cast anew (the last is narrower)


class _StoragesMade(TorchDispatchMode):
    """While on, the storages that ops make whose size in bytes `keep` accepts: `with ... as
    made` gives storage address -> the op that made it. Each such tensor is kept alive, so
    that no address is reused."""

    def __init__(self, keep) -> None:
        super().__init__()
        self.keep, self.made, self._alive = keep, {}, []

    def __enter__(self) -> dict[int, str]:
        super().__enter__()
        return self.made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.keep(t.untyped_storage().nbytes()):
                self.made.setdefault(t.untyped_storage().data_ptr(), str(func))
                self._alive.append(t)
        return out


def _hidden(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """The residual stream before the final norm (the model's own forward, without a cache)."""
    T = tokens.shape[1]
    h = model.embed(tokens)
    for layer in model.layers:
        h = layer(h, model.rope_cos[:T], model.rope_sin[:T])
    return h


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True])
def test_activation_checkpointing_gives_the_plain_backward_bit_for_bit(autocast: bool) -> None:
    """train.activation_checkpointing: each block keeps only its input and runs again in the
    backward, under the forward's autocast; the loss and every gradient are those of the plain
    model, bit for bit (float32 and bfloat16 autocast)."""
    cfg = model_config("debug")
    models = [build_model(cfg, seed=3) for _ in range(2)]
    models[1].activation_checkpointing = True
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in models:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_recompute_replays_the_forwards_random_draws() -> None:
    """A block that draws random numbers (dropout) draws the same ones when it runs again in
    the backward, so its gradients are those of the plain call; a second backward of the same
    graph (retain_graph) runs it again."""
    from fourfold.models.recompute import recompute_in_backward

    w = torch.randn(8, 8, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x @ w, p=0.5).tanh()

    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(5)
    plain = block(x).sum()
    plain.backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    torch.manual_seed(5)
    again = recompute_in_backward(block, x).sum()
    torch.rand(100)  # the global generator moves on before the backward
    again.backward(retain_graph=True)
    assert torch.equal(plain, again)
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], w.grad)
    x.grad = w.grad = None
    again.backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], w.grad)


@pytest.mark.slow
def test_a_meta_build_and_a_checkpointed_step_leave_torch_dynamo_unimported() -> None:
    """torch._dynamo costs about 70 MiB resident in every process, sympy (with torch's
    symbolic shapes) about 30: building a model on the meta device, parallelizing it and a
    checkpointed forward and backward must import neither (torch's own checkpoint, nn.init
    on meta tensors and torch.compiler.disable on Linear3D's forward would import dynamo;
    cloning a meta tensor's block would import sympy)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from fourfold.config import model_config, ParallelConfig\n"
            "from fourfold.models import build_model\n"
            "from fourfold.parallel import Grid, parallelize\n"
            "for tuned in (False, True):  # plain modules; Linear3D's (as on a grid)\n"
            "    model = build_model(model_config('debug'), seed=0, device='meta')\n"
            "    model.activation_checkpointing = True\n"
            "    pmodel = parallelize(model, Grid.single('cpu'),\n"
            "                         ParallelConfig(gemm_tuning=tuned), blocked_loss=True)\n"
            "    tokens = torch.randint(0, 100, (2, 9))\n"
            "    pmodel(tokens[:, :-1], tokens[:, 1:]).mean().backward()\n"
            "    assert all(p.grad is not None for p in pmodel.parameters())\n"
            "    assert tuned == ('Linear3D' in str(pmodel.module))\n"
            "    print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
            "from fourfold.parallel.grid import GridShape\n"
            "from fourfold.parallel.layout import Layout\n"
            "shape = GridShape(x=2, y=2)  # a rank's block of a meta table: a strided view\n"
            "block = Layout((('y', 'z'), ('x',))).shard(torch.empty(10, 6, device='meta'),\n"
            "                                           shape, shape.coords(3))\n"
            "assert block.is_meta and block.shape == (5, 3) and block.is_contiguous()\n"
            "from fourfold.config import Config\n"
            "from fourfold.train.trainer import count_parameters\n"
            "assert count_parameters(Config()) > 0  # the trainer's own meta build\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"] * 6, out.stdout


def test_a_block_forward_leaves_few_residual_sized_temporaries() -> None:
    """A block's forward with autograd on makes few tensors of the residual stream's size or
    larger that its backward does not keep: each is freed within the forward and, on a CPU
    process, leaves a hole in the heap between the kept ones that no later tensor of its size
    fits. Three are left: the query and key projections' outputs (RoPE writes new tensors) and
    the down projection's input (recomputed in backward). RoPE's chains, the norms' squares
    and products, SwiGLU's silu and the residual adds made thirteen more. RoPE's values and
    gradients are still HF's rotate-half expression's (to rounding: its products are fused
    now). float32, as a CPU run trains by default (under autocast the casts make their own)."""
    from fourfold.models.llama import apply_rope

    cfg = model_config("debug", n_kv_heads=4)  # keys the size of queries
    model = build_model(cfg, seed=0)
    B, T = 4, cfg.max_seq_len  # a block's activations larger than its weights
    x = torch.randn(B, T, cfg.dim, requires_grad=True)
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            _StoragesMade(lambda nbytes: nbytes >= x.nbytes) as made:  # storage -> its op
        y = model.layers[0](x, model.rope_cos[:T], model.rope_sin[:T])
    temporaries = sorted(op for ptr, op in made.items()
                         if ptr not in saved and ptr != y.untyped_storage().data_ptr())
    assert temporaries == ["aten.mm.default"] * 2 + ["aten.silu.default"], temporaries

    q = torch.randn(1, 2, 5, cfg.head_dim, dtype=torch.float64, requires_grad=True)
    cos, sin = model.rope_cos[:5].double(), model.rope_sin[:5].double()
    half = cfg.head_dim // 2
    rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)  # HF's rotate_half
    sign = torch.cat([-torch.ones(half), torch.ones(half)]).double()
    ref = q * cos + rotated * (sin * sign)  # rope_tables folds rotate_half's sign into sin
    assert torch.allclose(apply_rope(q, cos, sin), ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (q,))


def test_holds_result_allows_in_place_only_where_the_result_is_the_same_tensor() -> None:
    """The guard of the forwards' in-place products and sums (SwiGLU, the norm's weight, the
    residual add): the operand written must already have the result's dtype and shape."""
    from fourfold.parallel.linear import holds_result

    a = torch.ones(2, 3)
    assert holds_result(a, torch.ones(3))  # the other operand broadcasts into a
    assert holds_result(a, torch.ones(2, 3, dtype=torch.bfloat16))  # float32 wins
    assert not holds_result(torch.ones(3), a)  # the result is larger than the operand
    assert not holds_result(a.bfloat16(), a)  # the result is float32
    assert not holds_result(torch.ones(2, 3, dtype=torch.int64), a)
