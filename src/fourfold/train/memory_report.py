"""train.memory_report: the peak bytes of a rank by category, measured over the run's steps.

- parameters: the local shards' bytes;
- gradients: the most gradient bytes alive at once (after each backward; a fused method such
  as LOMO counts them as it frees them: its `peak_grad_bytes`);
- optimizer state: the method's (or AdamW's) state tensors;
- activations: the peak of the tensors autograd keeps for backward, counted by a
  saved-tensors hook (each storage once, parameters left out) while they are alive. With
  activation checkpointing, the inside of a checkpointed block saves under the checkpoint's
  own hooks: what is counted there is the block's input (a forward pre-hook), not one block's
  recompute during backward;
- communication buffers: the engine's gathered weight blocks (the largest, and the one
  prefetched beside it) and, with data > 1, what the data all-reduce holds beyond the gradients
  (parallel/data_parallel.py in_flight_wire_bytes).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from fourfold.parallel import ParallelModel
from fourfold.parallel.data_parallel import in_flight_wire_bytes


class _Saved:
    """A tensor kept for backward; its storage's count drops when autograd lets it go."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: MemoryMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class MemoryMeter:
    def __init__(self, pmodel: ParallelModel, method: Any, activation_checkpointing: bool) -> None:
        self.pmodel, self.method = pmodel, method
        self._param_storages = {p.untyped_storage().data_ptr() for p in pmodel.parameters()}
        self._live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self._live_bytes = 0
        self.peak = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "activations": 0,
                     "communication_buffers": 0}
        self._hooks: list[Any] = []
        self._block_inputs: dict[int, _Saved] = {}  # checkpointed blocks' inputs, this step
        layers = getattr(pmodel.module, "layers", None)
        if activation_checkpointing and layers is not None:
            for layer in layers:
                self._hooks.append(layer.register_forward_pre_hook(self._block_input))

    def _block_input(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled() and args and torch.is_tensor(args[0]):
            # the checkpoint keeps the block's input until the block's backward
            holder = self._pack(args[0])
            if isinstance(holder, _Saved):
                self._block_inputs[id(module)] = holder  # released at the end of the step

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._param_storages:
            return t
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self._live_bytes += entry[1]
            self.peak["activations"] = max(self.peak["activations"], self._live_bytes)
        entry[0] += 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._live_bytes -= entry[1]
            del self._live[key]

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Watch one training step."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        self._after_step()

    def _after_step(self) -> None:
        self._block_inputs.clear()
        params = list(self.pmodel.parameters())
        peak = self.peak
        peak["parameters"] = max(peak["parameters"],
                                 sum(p.numel() * p.element_size() for p in params))
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        grads = max(grads, getattr(self.method, "peak_grad_bytes", 0))
        peak["gradients"] = max(peak["gradients"], grads)
        peak["optimizer_state"] = max(peak["optimizer_state"], self.method.state_bytes())
        peak["communication_buffers"] = max(peak["communication_buffers"], self._comm_bytes())

    def _comm_bytes(self) -> int:
        engine = self.pmodel.engine
        if engine is None:
            return 0
        grid = self.pmodel.grid
        total = 0
        if grid.size("z") > 1 and engine.sharded:
            blocks = sorted((m.block_shape[0] * m.block_shape[1] * _element_size(m)
                             for m in engine.sharded), reverse=True)
            total += sum(blocks[:2] if engine.prefetch_enabled else blocks[:1])
        if grid.size("data") > 1 and self.peak["gradients"]:
            grad_bytes = next(self.pmodel.parameters()).element_size()
            total += in_flight_wire_bytes(min(engine.options.bucket_bytes, self.peak["gradients"]),
                                          grad_bytes, engine.options.reduce_dtype.itemsize)
        return total

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _element_size(module: Any) -> int:
    """Bytes per element of a z-sharded module's weight (a fused group: its first member's)."""
    weight = module.weight if hasattr(module, "weight") else module.members[0].weight
    return weight.element_size()


def gather_reports(meter: MemoryMeter, comm: Any,
                   peak_bytes: int) -> tuple[list[dict[str, int]], list[int]]:
    """Every rank's peaks by category and its `peak_bytes` (the process's peak as its system
    sees it: metrics.peak_memory_bytes), in rank order (collective over the whole grid)."""
    keys = list(meter.peak)
    mine = torch.tensor([float(meter.peak[k]) for k in keys] + [float(peak_bytes)],
                        dtype=torch.float64, device=comm.grid.device)
    if comm.grid.world_size == 1:
        rows = mine.view(1, -1)
    else:
        rows = comm.all_gather(mine.view(1, -1), "all").wait().view(-1, len(keys) + 1)
    values = [[int(v) for v in row.tolist()] for row in rows]
    return [dict(zip(keys, row)) for row in values], [row[-1] for row in values]


def predicted_report(breakdown: Any, z: int) -> dict[str, int]:
    """The planner's breakdown (plan/memory.py) in the report's categories; its gathered
    weights are communication buffers when z > 1 (with z = 1 that term is one layer's dW, a
    transient the report does not count)."""
    return {"parameters": breakdown.params, "gradients": breakdown.grads,
            "optimizer_state": breakdown.optimizer,
            "activations": breakdown.activations + breakdown.logits,
            "communication_buffers": (breakdown.gathered_weights if z > 1 else 0)
            + breakdown.comm_buffers}
