"""The planner against the heap at the 125m preset under bfloat16 autocast: minutes on a CPU
without bfloat16 GEMMs, so in a file of its own that a test run's workers take apart from
the rest."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_planner_lets_autocast_copies_go_before_the_loss_backward() -> None:
    """125m at 2 x 128 tokens, LOMO, bfloat16, one process: autocast's cached weight copies
    (126 MiB) go as the forward ends, before the blocked loss's backward makes the output
    layer's float32 dW and its bfloat16 weight anew. Counting them together read +15% against
    the heap in use (715 MiB); the forward's peak and the loss backward's apart, +4%."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import memory_lean

    from rank_memory_worker import run_method_steps

    from fourfold.config import model_config
    from fourfold.parallel import Grid, GridShape

    mcfg = model_config("125m")
    cfg = dataclasses.replace(memory_lean.train_config("lomo", 128, 4), dtype="bfloat16")
    # one step (of the second of two runs): LOMO keeps no state from step to step
    measured = run_method_steps(mcfg, Grid.single(), cfg, 2, steps=1)
    predicted = memory_lean.predicted_bytes(mcfg, cfg, 2 * 128, GridShape(1, 1, 1, 1),
                                            on_host=False)
    assert abs(predicted / measured - 1) < 0.06, (predicted, measured)
