"""Stopping a run on SIGTERM: every rank agrees after each step whether any rank received one
(a signal may reach only some ranks, or reach them at different steps), so that they all write
the same checkpoint and stop together."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fourfold.parallel import Grid
from fourfold.signals import StopSignals


class StopAgreement:
    """Asks, after a step, whether the run is to stop (collective on a grid: every rank calls
    `requested` after the same steps). The agreement runs on a gloo group of its own, apart
    from the training traffic and its ledger and from the checkpoint writer's group."""

    def __init__(self, signals: StopSignals, grid: Grid) -> None:
        self.signals = signals
        distributed = grid.world_size > 1 and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if distributed else None

    def requested(self) -> bool:
        flag = torch.tensor([1 if self.signals.terminated else 0], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
