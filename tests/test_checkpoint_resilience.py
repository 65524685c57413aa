"""Bad-step guards, straggler reports and restart records (fourfold.train.resilience)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fourfold.train.resilience import (LossGuard, restart_count, resume_record,
                                       straggler_report)


def test_non_finite_loss_or_gradient_is_bad() -> None:
    guard = LossGuard(spike_threshold=0.0)
    assert guard.check(2.0, 1.0) is None
    assert "loss is nan" in (guard.check(math.nan, 1.0) or "")
    assert "loss is inf" in (guard.check(math.inf, 1.0) or "")
    assert "gradient norm is inf" in (guard.check(2.0, math.inf) or "")


def test_spike_needs_history_and_a_threshold() -> None:
    guard = LossGuard(spike_threshold=2.0, window=4, min_history=3)
    guard.accept(1.0)
    guard.accept(1.0)
    assert guard.check(10.0, 1.0) is None  # too little history to judge
    guard.accept(1.0)
    assert guard.check(1.9, 1.0) is None
    reason = guard.check(2.5, 1.0)
    assert reason is not None and "spike" in reason and "2.5" in reason
    # the running mean follows the window: after higher losses 2.5 is normal
    for loss in (2.0, 2.0, 2.0, 2.0):
        guard.accept(loss)
    assert guard.check(2.5, 1.0) is None
    # spikes off
    off = LossGuard(spike_threshold=0.0, min_history=1)
    off.accept(1.0)
    assert off.check(1000.0, 1.0) is None


def test_guard_state_round_trip() -> None:
    guard = LossGuard(spike_threshold=3.0, window=3, min_history=1)
    for loss in (1.0, 2.0, 3.0, 4.0):
        guard.accept(loss)
    other = LossGuard(spike_threshold=3.0, window=3, min_history=1)
    other.load_state_dict(guard.state_dict())
    assert other.running_mean == guard.running_mean == 3.0
    assert other.check(9.5, 1.0) == guard.check(9.5, 1.0) is not None


def test_bad_spike_threshold_is_rejected() -> None:
    with pytest.raises(ValueError, match="spike_threshold"):
        LossGuard(spike_threshold=-1.0)


def test_straggler_report_names_the_slow_rank() -> None:
    assert straggler_report([0.50]) is None
    assert straggler_report([0.50, 0.52, 0.49, 0.51]) is None
    line = straggler_report([0.50, 0.52, 1.60, 0.51])
    assert line is not None and "rank 2" in line and "rank 0" not in line
    assert "\n" not in line
    # a tiny absolute gap is noise, not a straggler
    assert straggler_report([0.001, 0.001, 0.003, 0.001]) is None


def test_restart_records() -> None:
    assert restart_count({}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    record = resume_record(40, Path("run/checkpoints/step_00000040"), restarts=1)
    assert record["event"] == "restart" and record["step"] == 40
    assert resume_record(40, Path("x"), restarts=0)["event"] == "resume"
