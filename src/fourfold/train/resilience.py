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
from collections import deque
from pathlib import Path
from typing import Any

import torch

from fourfold.parallel.comm import Comm

SPIKE_WINDOW = 20  # accepted losses in the running mean
SPIKE_MIN_HISTORY = 5  # no spike verdicts before this many accepted losses
STRAGGLER_FACTOR = 1.5  # a rank this many times slower than the median is named
STRAGGLER_MIN_GAP_S = 0.05  # ...and at least this much slower, so noise on tiny steps is quiet


class LossGuard:
    """Says whether a step is bad: a non-finite loss or gradient norm, or a loss above
    `spike_threshold` times the running mean of recent accepted losses (0 disables spikes).
    Its history is part of a checkpoint (state_dict), so that a resumed run judges alike."""

    def __init__(self, spike_threshold: float, window: int = SPIKE_WINDOW,
                 min_history: int = SPIKE_MIN_HISTORY) -> None:
        if spike_threshold < 0 or not math.isfinite(spike_threshold):
            raise ValueError(f"train.spike_threshold = {spike_threshold}: must be 0 (off) or a "
                             "positive number")
        self.spike_threshold = spike_threshold
        self.min_history = min_history
        self.recent: deque[float] = deque(maxlen=window)

    @property
    def running_mean(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None

    def check(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is bad (one phrase), or None when it is fine."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        mean = self.running_mean
        if (self.spike_threshold > 0 and mean is not None and len(self.recent) >= self.min_history
                and loss > self.spike_threshold * mean):
            return (f"loss {loss:.4g} is a spike (over {self.spike_threshold:g} x the running "
                    f"mean {mean:.4g})")
        return None

    def accept(self, loss: float) -> None:
        """Record the loss of a step whose update was applied."""
        self.recent.append(float(loss))

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend(float(x) for x in state["recent"])


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


__all__ = ["LossGuard", "gather_step_times", "restart_count", "resume_record",
           "straggler_report"]
