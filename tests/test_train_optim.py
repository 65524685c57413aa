"""AdamW parameter groups and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from fourfold.config import TrainConfig, model_config
from fourfold.models.llama import build_model
from fourfold.train.optim import build_optimizer, lr_at, param_groups, uses_weight_decay


def test_lr_schedule_warmup_peak_and_end() -> None:
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(1, cfg) == pytest.approx(1e-4)
    assert lr_at(5, cfg) == pytest.approx(5e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)  # the peak, at the end of warmup
    assert lr_at(55, cfg) == pytest.approx(0.55e-3)  # half way down the cosine
    assert lr_at(100, cfg) == pytest.approx(1e-4)  # min_lr_ratio * lr at the last step
    values = [lr_at(s, cfg) for s in range(1, 101)]
    assert all(a < b for a, b in zip(values[:9], values[1:10]))
    assert all(a > b for a, b in zip(values[9:-1], values[10:]))


def test_lr_schedule_without_warmup_starts_at_the_peak() -> None:
    cfg = TrainConfig(steps=4, lr=2e-3, warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_at(s, cfg) for s in range(1, 5)] == pytest.approx(
        [2e-3 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(1, 5)])


def test_no_weight_decay_on_norms_biases_and_embeddings() -> None:
    model = build_model(model_config("debug", bias=True), seed=0)
    groups = param_groups(model.named_parameters(), weight_decay=0.1)
    decayed = set(groups[0]["names"])
    exempt = set(groups[1]["names"])
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed | exempt == {n for n, _ in model.named_parameters()}
    assert "embed.weight" in exempt and "norm.weight" in exempt
    assert "layers.0.attn_norm.weight" in exempt and "layers.1.ffn_norm.weight" in exempt
    assert "layers.0.attn.q_proj.bias" in exempt and "layers.1.ffn.down_proj.bias" in exempt
    assert "layers.0.attn.q_proj.weight" in decayed and "output.weight" in decayed
    assert all(n.endswith(".weight") and "norm" not in n and "embed" not in n for n in decayed)


def test_tied_output_weight_counts_as_the_embedding() -> None:
    assert uses_weight_decay("output.weight")
    assert not uses_weight_decay("output.weight", tied_output=True)
    model = build_model(model_config("debug", tie_embeddings=True), seed=0)
    cfg = TrainConfig(weight_decay=0.5)
    optimizer = build_optimizer(model.named_parameters(), cfg, tied_output=True)
    exempt = next(g for g in optimizer.param_groups if g["weight_decay"] == 0.0)
    assert any(p is model.output.weight for p in exempt["params"])


def test_weight_decay_acts_only_on_decayed_parameters() -> None:
    model = build_model(model_config("debug"), seed=0)
    cfg = TrainConfig(weight_decay=0.5, lr=0.1)
    optimizer = build_optimizer(model.named_parameters(), cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradients: only decay can move a weight
    optimizer.step()
    after = dict(model.named_parameters())
    assert torch.equal(after["embed.weight"], before["embed.weight"])
    assert torch.equal(after["norm.weight"], before["norm.weight"])
    torch.testing.assert_close(after["layers.0.attn.q_proj.weight"],
                               before["layers.0.attn.q_proj.weight"] * (1 - 0.1 * 0.5))
