"""What a user reads while a run trains, when the output is a pipe or a file: the header (method,
adapter, trainable parameters, init_from), the warmup warning, the first step's time, log lines
with the window's mean loss, elapsed time and time left, and no placeholder for a figure a
method has not got."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from fourfold.config import load_config
from fourfold.models.adapter import apply_adapter
from fourfold.models.llama import build_model
from fourfold.train import train
from fourfold.train.build import _planned_grid
from fourfold.train.metrics import LogWindow, read_metrics
from fourfold.train.progress import Progress, describe_run
from fourfold.train.trainer import count_parameters

from test_train import small_config

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_give_elapsed_time_and_time_left_from_after_the_first_step() -> None:
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(10, 0, 5, enabled=True, bar=False, stream=out, clock=clock)
    clock.now += 30.0  # a slow first step: compiling
    progress.first_step(1, 30.0)
    for step in range(2, 11):
        clock.now += 2.0
        progress.step(step, 3.0, 1e-3, 0.5, 100.0, None, loss_steps=5)
    lines = out.getvalue().splitlines()
    assert lines[0] == "first step (compiles/warms up) took 30.0 s"
    # step 5: 38 s since the start; 4 steps of 2 s since the first -> 5 steps left take 10 s
    assert lines[1].endswith("| 00:38 elapsed, ETA 00:10")
    assert lines[2].startswith("step 10/10 |") and lines[2].endswith("| 00:48 elapsed")
    assert "loss 3.0000 (mean of 5)" in lines[1]


def test_a_figure_a_method_has_not_got_is_left_out() -> None:
    out = io.StringIO()
    progress = Progress(2, 0, 1, enabled=True, bar=False, stream=out)
    progress.step(1, 3.0, 1e-3, math.nan, 100.0, None)
    progress.step(2, 3.0, 1e-3, None, 100.0, None)
    text = out.getvalue()
    assert "grad_norm" not in text and "nan" not in text and "mfu" not in text
    assert "loss 3.0000 |" in text  # one step's loss is not called a mean


def test_log_window_means_the_finite_losses_and_counts_all_tokens() -> None:
    window = LogWindow()
    for loss in (4.0, math.nan, 2.0):  # a skipped step's NaN is no loss to average
        window.add(100, 0.5, loss)
    assert window.mean_loss == 3.0 and window.loss_steps == 2
    assert window.tokens_per_s == pytest.approx(200.0)
    window.reset()
    assert math.isnan(window.mean_loss) and window.tokens == 0


def test_header_names_method_adapter_trainable_parameters_and_init_from(
        tmp_path: Path) -> None:
    cfg = load_config(None, ["model.preset=debug", "adapter.kind=lora", "adapter.r=4",
                             "adapter.targets=q,v", "train.optimizer=adamw",
                             f"model.init_from={tmp_path}", "train.steps=10",
                             "train.warmup_steps=20"])
    model = build_model(cfg.model, device="meta")
    names = set(apply_adapter(model, cfg.adapter, 0))
    trainable = sum(p.numel() for n, p in model.named_parameters() if n in names)
    # r x (in + out) for each q and v projection of each layer
    m = cfg.model
    per_layer = 4 * (m.dim + m.dim) + 4 * (m.dim + m.n_kv_heads * m.head_dim)
    assert trainable == m.n_layers * per_layer
    assert count_parameters(cfg, trainable_only=True) == trainable
    total = count_parameters(cfg)
    header, warning = describe_run(cfg, "data=1 z=1 y=1 x=1", "cpu", 1024, "DATA", total,
                                   trainable)
    assert f"from {tmp_path}," in header and "optimizer adamw" in header
    assert f"adapter LoRA r=4 on q,v: {trainable / 1e6:.2f}M trainable parameters" in header
    assert header.count("grid ") == 1 and "logged loss: the mean" in header
    assert warning.startswith("warning: train.warmup_steps = 20 is more than train.steps = 10")
    full = load_config(None, ["model.preset=debug"])
    assert len(describe_run(full, "g", "cpu", 1, "D", total, total)) == 1  # no warning
    assert "adapter" not in describe_run(full, "g", "cpu", 1, "D", total, total)[0]


@pytest.mark.slow
def test_a_piped_run_logs_window_means_timing_and_the_first_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train(small_config("train.steps=6", "train.log_every=3"), tmp_path,
                   progress=False)
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("first step (compiles/warms up) took ") for line in err)
    steps = [line for line in err if line.startswith("step ")]
    assert steps[0].startswith("step 3/6 | loss ") and "(mean of 3)" in steps[0]
    assert "elapsed, ETA " in steps[0] and steps[1].endswith(" elapsed")
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [3, 6]
    for record, window in zip(records, (result.losses[:3], result.losses[3:])):
        assert record["loss"] == pytest.approx(window[-1])  # the step's own beside the mean
        assert record["loss_mean"] == pytest.approx(sum(window) / 3)
        assert f"loss {record['loss_mean']:.4f} (mean of 3)" in "\n".join(steps)


@pytest.mark.slow
def test_lomo_logs_no_gradient_norm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train(small_config("train.steps=2", "train.optimizer=lomo", "train.lr=1e-2"), tmp_path,
          progress=False)
    err = capsys.readouterr().err
    assert "step 2/2 | loss" in err and "grad_norm" not in err and "nan" not in err
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert records and all("grad_norm" not in r for r in records)


def test_parallel_auto_says_its_choice_once(capsys: pytest.CaptureFixture[str]) -> None:
    shape = _planned_grid(small_config("parallel.auto=true", "parallel.machine=h100-sxm"), 1, 0)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"parallel.auto: planner chose {shape} on ")
    assert first.count(str(shape)) == 1
