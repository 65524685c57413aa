"""No host read inside a training step: the loss guard decides on the device, and the trainer
reads the step's numbers only on logging steps (and checkpoints, validation, the end).

On a CPU a CUDA sync cannot be seen, so the tests trap what would cause one: every way Python
can read a tensor's value (item, tolist, float/int/bool/index, numpy, cpu) and boolean-mask
indexing, while the trainer runs."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fourfold.config import Config, load_config
from fourfold.train import Trainer, TrainingError
from fourfold.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py

_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


def _config(*overrides: str) -> Config:
    return load_config(None, ["model.preset=debug", "train.batch_size=8", "train.seq_len=32",
                              "train.steps=6", "train.warmup_steps=2", "train.eval_every=0",
                              "train.eval_batches=0", "train.sample_tokens=0",
                              "train.grad_accum=2", *overrides])


def _trap_reads(monkeypatch: pytest.MonkeyPatch, on_read: Callable[[str], None]) -> None:
    """Call on_read(name) at every host read of a tensor's value (then do the read)."""
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args, _name: str = name, _original=original, **kwargs):
            on_read(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    getitem = torch.Tensor.__getitem__

    def index(self: torch.Tensor, key):  # boolean-mask indexing must learn the count
        keys = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
            on_read("boolean-mask indexing")
        return getitem(self, key)

    monkeypatch.setattr(torch.Tensor, "__getitem__", index)


def test_steps_read_the_host_only_when_they_log(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # clipping, spikes and the skip policy on: every part of the guard runs on each step
    trainer = Trainer(_config("train.log_every=3", "train.grad_clip=0.5",
                              "train.spike_threshold=3", "train.nan_policy=skip"),
                      tmp_path, progress=False)
    assert trainer.method.optimizer.defaults.get("fused")  # the device-side skip needs it
    inside: list[tuple[int, str]] = []  # reads during train_step: (step, what)
    between: dict[int, list[str]] = {}  # reads after step N, before step N + 1
    in_step = [False]

    def on_read(name: str) -> None:
        if in_step[0]:
            inside.append((trainer.step + 1, name))
        else:
            between.setdefault(trainer.step, []).append(name)

    original_step = trainer.train_step

    def train_step():
        in_step[0] = True
        try:
            return original_step()
        finally:
            in_step[0] = False

    trainer.train_step = train_step  # type: ignore[method-assign]
    _trap_reads(monkeypatch, on_read)
    result = trainer.fit()
    monkeypatch.undo()
    assert inside == []
    assert 1 not in between and 2 not in between and 4 not in between and 5 not in between
    assert "tolist" in between[3]  # the logging step reads steps 1-3 in one transfer
    assert result.steps == 6 and len(result.losses) == 6
    assert all(math.isfinite(x) for x in result.losses)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [3, 6]
    assert records[-1]["loss"] == result.losses[-1] and records[-1]["grad_norm"] > 0


def _poison(trainer: Trainer, bad_step: int) -> None:
    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output * math.nan if trainer.step + 1 == bad_step else output

    trainer.pmodel.module.norm.register_forward_hook(hook)


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in trainer.pmodel.named_parameters()}
    names = {id(p): n for n, p in trainer.pmodel.named_parameters()}
    for p, state in trainer.method.optimizer.state.items():
        for key, value in state.items():
            out[f"{names[id(p)]}/{key}"] = value.detach().clone()
    return out


def test_a_skip_on_the_device_equals_a_skip_on_the_host(tmp_path: Path) -> None:
    """A bad step on a non-logging step: the fused AdamW kernel leaves weights, moments and the
    step count bit for bit as a step the host never took, and the skip is counted when read."""
    device = Trainer(_config("train.log_every=4", "train.nan_policy=skip"), tmp_path / "device",
                     progress=False)
    host = Trainer(_config("train.log_every=1", "train.nan_policy=skip"), tmp_path / "host",
                   progress=False)
    optimizer = host.method.optimizer

    def host_skip(applied: torch.Tensor) -> None:  # what the trainer did before: ask the host
        if bool(applied):
            optimizer.step()

    host.method._step_if = host_skip  # type: ignore[attr-defined]
    for trainer in (device, host):
        _poison(trainer, 3)
    results = [device.fit(), host.fit()]
    assert [r.skipped_steps for r in results] == [[3], [3]]
    assert math.isnan(results[0].losses[2]) and results[0].losses[3:] == results[1].losses[3:]
    a, b = _state(device), _state(host)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert float(a[next(k for k in a if k.endswith("/step"))]) == 5  # one of six skipped
    records = read_metrics(tmp_path / "device" / "metrics.jsonl")
    skipped = [r for r in records if r.get("skipped")]
    assert [r["step"] for r in skipped] == [3] and "loss is nan" in skipped[0]["skip_reason"]
    assert [r["step"] for r in records if not r.get("skipped")] == [4, 6]
    summary = json.loads((tmp_path / "device" / "summary.json").read_text())
    assert summary["skipped_steps"] == [3]


def test_spikes_between_logging_steps_are_counted(tmp_path: Path) -> None:
    cfg = _config("train.steps=7", "train.spike_threshold=0.5", "train.nan_policy=skip",
                  "train.log_every=7")
    result = Trainer(cfg, tmp_path, progress=False).fit()
    assert result.skipped_steps == [6, 7]
    skipped = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("skipped")]
    assert [r["step"] for r in skipped] == [6, 7]
    assert all("spike" in r["skip_reason"] for r in skipped)


def test_stop_on_a_non_logging_step_names_it_and_keeps_its_weights(tmp_path: Path) -> None:
    trainer = Trainer(_config("train.log_every=5"), tmp_path, progress=False)
    _poison(trainer, 2)
    after_first: dict[str, torch.Tensor] = {}
    original_step = trainer.train_step

    def train_step():
        stats = original_step()
        if stats.step == 1:
            after_first.update(_state(trainer))
        return stats

    trainer.train_step = train_step  # type: ignore[method-assign]
    with pytest.raises(TrainingError, match=r"^step 2: loss is nan") as info:
        trainer.fit()
    assert info.value.step == 2 and trainer.step == 5  # seen at the logging step
    now = _state(trainer)  # steps 3-5 were held on the device: still the weights of step 1
    assert all(torch.equal(now[k], after_first[k]) for k in after_first)
    assert not (tmp_path / "model.safetensors").exists()
