"""The CPU trainer's malloc tuning: a repeated pattern of large allocations stops costing
fresh zero-filled pages. Run in fresh interpreters, so that neither test inherits the other's
(or pytest's) malloc state."""

import os
import subprocess
import sys

import pytest

PROGRAM = r"""
import resource, sys, torch
from fourfold.train.host_memory import keep_freed_host_memory

def step():  # tensors of a training step's sizes (1 MiB .. 120 MiB), then freed
    tensors = [torch.ones(n) for n in (250_000, 2_000_000, 8_000_000, 30_000_000, 4_000_000)]
    del tensors

step()  # the trainer tunes malloc after the process has been at work for a while
tuned = keep_freed_host_memory() if sys.argv[1] == "tuned" else False
faults = []
for _ in range(12):  # glibc's heap settles its layout within about six rounds
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(tuned, *faults)
"""


def _faults(mode: str) -> tuple[bool, list[int]]:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", [int(v) for v in out[1:]]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_tuned_heap_reuses_pages_that_the_default_heap_faults_in_again():
    tuned, faults = _faults("tuned")
    assert tuned
    first, later = faults[0], faults[-4:]
    assert first > 20_000  # ~175 MiB of new pages the first time
    assert max(later) < first // 100, faults  # then reused: next to no new pages
    _, default = _faults("default")
    assert min(default[-4:]) > first // 4, default  # glibc's default gives them back each time


def test_user_malloc_settings_are_left_alone(monkeypatch):
    from fourfold.train import host_memory

    monkeypatch.setattr(host_memory, "_done", False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert host_memory.keep_freed_host_memory() is False
