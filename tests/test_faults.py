"""A rank that dies or hangs ends the job within the timeout, with a message that names the
rank that reports it and the axis of the collective it was in — never an endless hang."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks

WORKER = Path(__file__).with_name("fault_worker.py")


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_dead_or_hung_rank_ends_the_job(mode: str) -> None:
    env = dict(os.environ, FOURFOLD_FAULT=mode, FOURFOLD_FAULT_TIMEOUT="5", OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(WORKER)],
                          env=env, capture_output=True, text=True, timeout=240)
    wall = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    reports = re.findall(r"FAULT-REPORT rank=(\d+) elapsed=([\d.]+) message=(.*)", out)
    assert reports, out[-3000:]
    rank, elapsed, message = reports[0]
    assert rank == "0"
    assert "rank 0" in message and "over axis x" in message, message
    assert float(elapsed) < 60, f"took {elapsed}s to notice"
    assert wall < 200
