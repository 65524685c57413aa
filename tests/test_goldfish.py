"""The goldfish mask: determined by the text alone, drops about 1/k, exact under batch sharding."""

import math
import os
import subprocess
import sys

import pytest
import torch

from fourfold.config import ConfigError, ModelConfig
from fourfold.models import build_model
from fourfold.train.goldfish import goldfish_mask

K, H = 4, 13


def goldfish_kept_band(k: int, h: int, seq_len: int, verdicts: int) -> tuple[float, float]:
    """The fraction of a row's targets the goldfish loss keeps, and its tolerance. The first
    h - 1 targets of a row lack h tokens of context and are always kept; each later one is
    dropped when the hash of its context falls in 1 of k buckets: `verdicts` independent
    draws with p = 1/k (the distinct contexts behind the fraction), held to 4 standard
    deviations."""
    eligible = (seq_len - h + 1) / seq_len
    sigma = math.sqrt((1 / k) * (1 - 1 / k) / verdicts)
    return 1 - eligible / k, 4 * sigma * eligible


def _inputs_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rows[:, :-1], rows[:, 1:]


def _random_text(n: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_same_text_same_mask_at_any_row_and_offset():
    text = _random_text(600)
    T = 256
    offsets = [0, 1, 37, 200]
    # The same windows in a different row order, next to unrelated rows.
    rows = torch.stack([_random_text(T + 1, seed=9)] + [text[o:o + T + 1] for o in offsets])
    inputs, targets = _inputs_targets(rows)
    mask = goldfish_mask(inputs, targets, K, H)
    assert mask.shape == inputs.shape and mask.dtype == torch.bool

    # Map each row's mask back to absolute positions of `text`; where two rows see the same
    # target with a full h-token context inside their window, they must agree.
    seen: dict[int, bool] = {}
    compared = 0
    for row, offset in enumerate(offsets, start=1):
        for t in range(H - 1, T):
            absolute = offset + t  # target = text[absolute + 1]
            verdict = bool(mask[row, t])
            if absolute in seen:
                assert seen[absolute] == verdict, (row, t)
                compared += 1
            seen[absolute] = verdict
    assert compared > 500
    # ...and the verdicts are not all the same (the mask does drop something).
    assert 0 < sum(not v for v in seen.values()) < len(seen)


def test_repeated_passage_in_one_row_drops_the_same_positions():
    passage = _random_text(100, seed=1)
    row = torch.cat([_random_text(30, seed=2), passage, _random_text(17, seed=3), passage])
    inputs, targets = _inputs_targets(row[None])
    mask = goldfish_mask(inputs, targets, K, H)[0]
    first, second = 30, 30 + 100 + 17
    # targets inside the passage whose h-token context is inside the passage
    span = range(H - 1, 99)
    assert [bool(mask[first + i]) for i in span] == [bool(mask[second + i]) for i in span]


def test_verdict_depends_only_on_the_h_preceding_tokens():
    row = _random_text(400, seed=4)
    changed = row.clone()
    changed[100] = (changed[100] + 1) % 256
    m1 = goldfish_mask(*_inputs_targets(row[None]), K, H)[0]
    m2 = goldfish_mask(*_inputs_targets(changed[None]), K, H)[0]
    # targets t with context inputs[t-h+1..t] not covering index 100 are unchanged
    untouched = [t for t in range(399) if not (t - H + 1 <= 100 <= t)]
    assert all(bool(m1[t]) == bool(m2[t]) for t in untouched)
    # the h contexts that cover the change get freshly hashed verdicts; over many such edits
    # some verdicts must flip, otherwise the hash ignores the token
    flips = 0
    for position in range(50, 350, 10):
        edited = row.clone()
        edited[position] = (edited[position] + 7) % 256
        m3 = goldfish_mask(*_inputs_targets(edited[None]), K, H)[0]
        flips += int((m1 != m3).sum())
    assert flips > 10


def test_short_context_is_never_dropped():
    inputs = torch.zeros(3, 40, dtype=torch.long)  # constant text: hash of zeros
    row = _random_text(41, seed=5)[None]
    for h in (1, 5, 13):
        mask = goldfish_mask(*_inputs_targets(row), K, h)
        assert mask[0, :h - 1].all()
    # shorter than h: nothing has a full context, nothing is dropped
    assert goldfish_mask(inputs[:, :H - 1], inputs[:, :H - 1], K, H).all()


@pytest.mark.parametrize("k", [2, 4, 8])
def test_drop_fraction_is_about_one_in_k(k):
    text = _random_text(20_001, vocab=50_000, seed=6)[None]
    mask = goldfish_mask(*_inputs_targets(text), k, H)
    dropped = 1.0 - mask[:, H - 1:].float().mean().item()
    assert abs(dropped - 1.0 / k) < 0.03, dropped


def test_drop_fraction_on_byte_text():
    import inspect

    text = torch.tensor(list(inspect.getsource(torch.nn.modules.module).encode()[:20_001]))
    mask = goldfish_mask(*_inputs_targets(text[None]), K, H)
    dropped = 1.0 - mask[:, H - 1:].float().mean().item()
    assert abs(dropped - 0.25) < 0.03, dropped


@pytest.mark.parametrize("k", [1, 0, -3])
def test_k_below_two_is_an_error_naming_goldfish_k(k):
    x = torch.zeros(1, 20, dtype=torch.long)
    with pytest.raises(ConfigError, match="goldfish_k"):
        goldfish_mask(x, x, k, H)


def test_h_below_one_is_an_error_naming_goldfish_h():
    x = torch.zeros(1, 20, dtype=torch.long)
    with pytest.raises(ValueError, match="goldfish_h"):
        goldfish_mask(x, x, K, 0)


def test_mismatched_shapes_are_an_error():
    with pytest.raises(ValueError, match="inputs"):
        goldfish_mask(torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long),
                      K, H)


_CHILD = """
import sys, torch
from fourfold.train.goldfish import goldfish_mask
x = torch.randint(0, 1000, (4, 301), generator=torch.Generator().manual_seed(11))
m = goldfish_mask(x[:, :-1], x[:, 1:], 4, 13)
sys.stdout.write("".join("1" if v else "0" for v in m.flatten().tolist()))
"""


@pytest.mark.slow
def test_same_mask_in_a_separate_process():
    x = torch.randint(0, 1000, (4, 301), generator=torch.Generator().manual_seed(11))
    here = "".join("1" if v else "0" for v in
                   goldfish_mask(x[:, :-1], x[:, 1:], 4, 13).flatten().tolist())
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different salt for Python's hash()
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                           env=env, check=True, timeout=120)
    assert child.stdout == here


def test_masked_loss_on_shards_equals_loss_on_whole_batch():
    cfg = ModelConfig(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64,
                      max_seq_len=64)
    model = build_model(cfg, seed=0)
    rows = torch.randint(0, 64, (8, 49), generator=torch.Generator().manual_seed(7))
    inputs, targets = _inputs_targets(rows)

    mask = goldfish_mask(inputs, targets, K, 5)
    per_token = model(inputs, targets)
    whole = (per_token * mask).sum() / mask.sum()
    whole.backward()
    whole_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # As the trainer does on a grid: each shard computes its own mask, the count is global.
    shards = [(inputs[i:i + 2], targets[i:i + 2]) for i in range(0, 8, 2)]
    masks = [goldfish_mask(x, y, K, 5) for x, y in shards]
    global_count = sum(m.sum() for m in masks)
    total = torch.zeros(())
    for (x, y), m in zip(shards, masks):
        loss = (model(x, y) * m).sum() / global_count
        loss.backward()
        total += loss.detach()

    assert torch.equal(torch.cat(masks), mask)
    assert mask.sum() < mask.numel()  # something was dropped
    torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole_grads[n], rtol=1e-5, atol=1e-7)
