"""Keeping a long run alive: bad-step guards (NaN/inf, loss spikes), straggler reports, and the
record of a restart or resume.

The trainer owns the policy (train.nan_policy): "stop" raises, "skip" drops the step's update,
"rollback" reloads the last checkpoint's weights and optimizer state and goes on with the next
batches (the ones that led to the bad step are not replayed, or the run would meet them again).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fourfold.parallel.comm import Comm

SPIKE_WINDOW = 20  # accepted losses in the running mean
SPIKE_MIN_HISTORY = 5  # no spike verdicts before this many accepted losses
STRAGGLER_FACTOR = 1.5  # a rank this many times slower than the median is named
STRAGGLER_MIN_GAP_S = 0.05  # ...and at least this much slower, so noise on tiny steps is quiet


# Verdict codes of LossGuard.judge (device tensors hold these).
FINE, LOSS_NOT_FINITE, NORM_NOT_FINITE, SPIKE = 0, 1, 2, 3


@dataclass
class Verdict:
    """A LossGuard's judgement of one step, as 0-d device tensors: the host reads them only
    when it reports the step (a logging step), never to decide the update."""

    code: torch.Tensor  # int64: FINE, LOSS_NOT_FINITE, NORM_NOT_FINITE or SPIKE
    loss: torch.Tensor  # float64
    grad_norm: torch.Tensor  # float64
    mean: torch.Tensor  # float64: the running mean the loss was judged against (NaN: none)

    @property
    def bad(self) -> torch.Tensor:
        return self.code != FINE


class LossGuard:
    """Says whether a step is bad: a non-finite loss or gradient norm, or a loss above
    `spike_threshold` times the running mean of recent accepted losses (0 disables spikes).
    Its history is part of a checkpoint (state_dict), so that a resumed run judges alike.

    The history lives in a device tensor: `judge` and `record` decide and remember without a
    host read (the trainer's path); `check` and `accept` take host floats (training methods
    that read their loss anyway, and tests) and act on the same history."""

    def __init__(self, spike_threshold: float, window: int = SPIKE_WINDOW,
                 min_history: int = SPIKE_MIN_HISTORY) -> None:
        if spike_threshold < 0 or not math.isfinite(spike_threshold):
            raise ValueError(f"train.spike_threshold = {spike_threshold}: must be 0 (off) or a "
                             "positive number")
        self.spike_threshold = spike_threshold
        self.min_history = min_history
        self.window = window
        # the last `window` accepted losses, newest last; zeros before the first `count`
        self._history = torch.zeros(window, dtype=torch.float64)
        self._count = torch.zeros((), dtype=torch.int64)

    def _on(self, device: torch.device) -> None:
        if self._history.device != device:  # once: the guard is built before the device is known
            self._history, self._count = self._history.to(device), self._count.to(device)

    @property
    def recent(self) -> list[float]:
        """The accepted losses in the history, oldest first (a host read)."""
        n = int(self._count)
        return self._history[self.window - n:].tolist() if n else []

    @property
    def running_mean(self) -> float | None:
        recent = self.recent
        return sum(recent) / len(recent) if recent else None

    def check(self, loss: float, grad_norm: float | None) -> str | None:
        """Why this step is bad (one phrase), or None when it is fine (`grad_norm` None: not
        known, only the loss is judged)."""
        recent = self.recent
        mean = sum(recent) / len(recent) if recent else None
        if not math.isfinite(loss):
            code = LOSS_NOT_FINITE
        elif grad_norm is not None and not math.isfinite(grad_norm):
            code = NORM_NOT_FINITE
        elif (self.spike_threshold > 0 and mean is not None and len(recent) >= self.min_history
                and loss > self.spike_threshold * mean):
            code = SPIKE
        else:
            code = FINE
        return self.reason(code, loss, math.nan if grad_norm is None else grad_norm,
                           math.nan if mean is None else mean)

    def reason(self, code: int, loss: float, grad_norm: float, mean: float) -> str | None:
        """The phrase for a verdict code (None for FINE), from the verdict's numbers."""
        if code == LOSS_NOT_FINITE:
            return f"loss is {loss}"
        if code == NORM_NOT_FINITE:
            return f"gradient norm is {grad_norm}"
        if code == SPIKE:
            return (f"loss {loss:.4g} is a spike (over {self.spike_threshold:g} x the running "
                    f"mean {mean:.4g})")
        return None

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Verdict:
        """`check` on the device: the same verdict, as tensors, with no host read."""
        self._on(loss.device)
        loss, norm = loss.detach().double(), grad_norm.detach().double().to(loss.device)
        count = self._count
        mean = self._history.sum() / count.clamp(min=1)
        spike = torch.zeros((), dtype=torch.bool, device=loss.device)
        if self.spike_threshold > 0:
            spike = (count >= max(self.min_history, 1)) & (loss > self.spike_threshold * mean)
        code = torch.where(~torch.isfinite(loss), LOSS_NOT_FINITE,
                           torch.where(~torch.isfinite(norm), NORM_NOT_FINITE,
                                       torch.where(spike, SPIKE, FINE)))
        return Verdict(code, loss, norm, torch.where(count > 0, mean, math.nan))

    def record(self, loss: torch.Tensor, applied: torch.Tensor) -> None:
        """`accept` on the device: remember the loss where `applied` (a bool tensor) is true."""
        self._on(loss.device)
        shifted = torch.cat([self._history[1:], loss.detach().double().reshape(1)])
        self._history = torch.where(applied, shifted, self._history)
        self._count = torch.where(applied, (self._count + 1).clamp(max=self.window), self._count)

    def accept(self, loss: float) -> None:
        """Record the loss of a step whose update was applied."""
        self.record(torch.tensor(float(loss), dtype=torch.float64, device=self._history.device),
                    torch.ones((), dtype=torch.bool, device=self._history.device))

    def state_dict(self) -> dict[str, Any]:
        return {"recent": self.recent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        recent = [float(x) for x in state["recent"]][-self.window:]
        history = torch.zeros(self.window, dtype=torch.float64)
        if recent:
            history[self.window - len(recent):] = torch.tensor(recent, dtype=torch.float64)
        device = self._history.device
        self._history = history.to(device)
        self._count = torch.tensor(len(recent), dtype=torch.int64, device=device)


@dataclass(frozen=True)
class DeviceJudgement:
    """A step the guard judged on the device: its verdict and whether its update was applied
    (bool tensor)."""

    verdict: Verdict
    applied: torch.Tensor


@dataclass(frozen=True)
class HostJudgement:
    """A step the guard judged on the host: its numbers and the reason to reject it (None:
    fine)."""

    loss: float
    grad_norm: float
    reason: str | None


class UpdateGate:
    """The loss guard and train.nan_policy at the update, as the trainer hands them to its
    training method each step (methods.base.StepGuard), keeping the step's judgement for the
    trainer to report: on the device (`allow`, AdamW: nothing waits for the host) or on the
    host (`check`, the methods that read their loss anyway). `hold_after_bad`
    (nan_policy = "stop"): after a bad step no update is applied until the host has seen it
    (the trainer stops there)."""

    def __init__(self, guard: LossGuard, hold_after_bad: bool) -> None:
        self.guard = guard
        self.hold_after_bad = hold_after_bad
        self._held: torch.Tensor | None = None  # a bad step held every update since
        self.judgement: DeviceJudgement | HostJudgement | None = None  # this step's

    def begin_step(self) -> None:
        self.judgement = None

    def allow(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        verdict = self.guard.judge(loss, grad_norm)
        applied = ~verdict.bad
        if self.hold_after_bad:
            if self._held is not None:
                applied = applied & ~self._held
            self._held = ~applied
        self.guard.record(verdict.loss, applied)
        self.judgement = DeviceJudgement(verdict, applied)
        return applied

    def check(self, loss: float, grad_norm: float | None) -> str | None:
        reason = self.guard.check(loss, grad_norm)
        if reason is None:
            self.guard.accept(loss)
        self.judgement = HostJudgement(loss, math.nan if grad_norm is None else grad_norm,
                                       reason)
        return reason


# --------------------------------------------------------------------------------------------
# stragglers


def gather_step_times(seconds: float, comm: Comm | None = None) -> list[float]:
    """Every rank's step time, in rank order (collective over the whole grid of `comm`; on one
    process just [seconds])."""
    if comm is None or comm.grid.world_size == 1:
        return [float(seconds)]
    mine = torch.tensor([float(seconds)], dtype=torch.float64, device=comm.grid.device)
    return [float(t) for t in comm.all_gather(mine, "all").wait().tolist()]


def straggler_report(times: list[float], factor: float = STRAGGLER_FACTOR,
                     min_gap_s: float = STRAGGLER_MIN_GAP_S) -> str | None:
    """One line naming the ranks much slower than the median, or None."""
    if len(times) < 2:
        return None
    median = statistics.median(times)
    slow = [(r, t) for r, t in enumerate(times)
            if t > factor * median and t - median > min_gap_s]
    if not slow:
        return None
    named = ", ".join(f"rank {r} ({t:.3f} s)" for r, t in slow)
    return f"straggler: {named} vs a median step time of {median:.3f} s over {len(times)} ranks"


# --------------------------------------------------------------------------------------------
# restarts


def restart_count(env: dict[str, str] | None = None) -> int:
    """How many times torch elastic has restarted this job (0 on the first attempt)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def resume_record(step: int, checkpoint: Path, restarts: int) -> dict[str, Any]:
    """The metrics.jsonl line for continuing from a checkpoint: event "restart" after an
    elastic restart (a failed rank), "resume" when a user resumed a stopped run."""
    return {"event": "restart" if restarts > 0 else "resume", "step": step,
            "checkpoint": str(checkpoint), "restart_count": restarts}


__all__ = ["FINE", "LOSS_NOT_FINITE", "NORM_NOT_FINITE", "SPIKE", "DeviceJudgement",
           "HostJudgement", "LossGuard", "UpdateGate", "Verdict", "gather_step_times", "restart_count", "resume_record", "straggler_report"]
