"""Activation checkpointing: a block keeps only its inputs, and its backward runs the block's
forward again for the tensors autograd saved.

The same thing as torch.utils.checkpoint's non-reentrant form (saved-tensor hooks: the forward
saves a number in place of each tensor, the first unpack in a backward runs the block again
and hands back the tensors in the order they were saved), without torch's import of
torch._dynamo at the first call (about 70 MiB resident in every process and a second; a run
that trains with anything but AdamW, whose torch.optim imports it too, never needs it
otherwise). The recompute runs under the forward's autocast and random state, with the same
inputs (detached, requires_grad as they came) and so saves the same tensors; it stops at
the last of them (the block's tail, its output among it, is not made again: on a 2x2 rank,
125m, LOMO's peak read about 30 MiB more, and its tokens/s 4% less, without the stop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _StopRecompute(Exception):
    """Raised where the recompute has saved all the forward's tensors: the block's output and
    whatever follows the last saved tensor are never made again (as torch's early stop)."""


class _Block:
    """One checkpointed call: its inputs, their state, and the tensors its recompute saved."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        device = next((a.device for a in args if isinstance(a, torch.Tensor)),
                      torch.device("cpu"))
        self.autocast = (torch.is_autocast_enabled(device.type),
                         torch.get_autocast_dtype(device.type))
        self.cpu_autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        self.device = device
        self.saved_count = 0  # tensors the forward saved
        self.recomputed: list[torch.Tensor | None] | None = None
        self.left = 0  # recomputed tensors not yet handed to this backward

    def pack(self, _: torch.Tensor) -> int:
        self.saved_count += 1
        return self.saved_count - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.recomputed is None:  # the first unpack of this backward
            self.recomputed = self._recompute()
            self.left = len(self.recomputed)
        tensor = self.recomputed[index]
        if tensor is None:
            raise RuntimeError("activation checkpointing: a saved tensor was asked for twice in "
                               "one backward")
        self.recomputed[index] = None  # each goes as soon as autograd has it
        self.left -= 1
        if self.left == 0:  # all handed back: another backward (retain_graph) recomputes
            self.recomputed = None
        return tensor

    def _recompute(self) -> list[torch.Tensor | None]:
        saved: list[torch.Tensor | None] = []

        def keep(t: torch.Tensor) -> int:
            saved.append(t)
            if len(saved) == self.saved_count:  # the rest of the block is not needed
                raise _StopRecompute
            return len(saved) - 1

        args = tuple(_detached(a) for a in self.args)
        devices = [self.device] if self.device_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng, self.device)
            with torch.enable_grad(), \
                    torch.autocast(self.device.type, dtype=self.autocast[1],
                                   enabled=self.autocast[0]), \
                    torch.autocast("cpu", dtype=self.cpu_autocast[1],
                                   enabled=self.cpu_autocast[0]), \
                    torch.autograd.graph.saved_tensors_hooks(keep, saved.__getitem__):
                try:
                    self.fn(*args)
                except _StopRecompute:
                    pass
        if len(saved) != self.saved_count:
            raise RuntimeError(f"activation checkpointing: the recompute saved {len(saved)} "
                               f"tensors, the forward {self.saved_count}; the block must save "
                               "the same tensors each time it runs")
        return saved


def _detached(a: Any) -> Any:
    if not isinstance(a, torch.Tensor):
        return a
    return a.detach().requires_grad_(a.requires_grad)


def recompute_in_backward(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """fn(*args), keeping for the backward only `args` (held until the backward is done) and
    running fn again there. Without grad mode it is just fn(*args)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    block = _Block(fn, args)
    with torch.autograd.graph.saved_tensors_hooks(block.pack, block.unpack):
        return fn(*args)
