"""An independent count of what torch.distributed is handed: wraps its tensor collectives
(not fourfold's ledger) and records, per call, the op, the process group and the bytes of the
buffer (input of an all-reduce or reduce-scatter, output of an all-gather). Used by
parallel_worker.py and bench/comm_table.py to hold the ledger honest."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

_WRAPPED = {  # torch.distributed function -> (op, index of the buffer the ledger counts)
    "all_reduce": ("all_reduce", 0),
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
}


class DistCount:
    """Install with `install()`, read `records` [(op, group, nbytes, dtype)], `uninstall()`."""

    def __init__(self) -> None:
        self.records: list[tuple[str, Any, int, torch.dtype]] = []
        self._originals: dict[str, Callable[..., Any]] = {}
        self._depth = 0  # one public call may call another (a renamed alias): count it once

    def install(self) -> "DistCount":
        for name, (op, index) in _WRAPPED.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._originals[name] = fn
            setattr(dist, name, self._wrap(fn, op, index))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, fn: Callable[..., Any], op: str, index: int) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                t = args[index]
                self.records.append((op, kwargs.get("group"), t.numel() * t.element_size(),
                                     t.dtype))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return wrapper

    def reset(self) -> None:
        self.records.clear()

    def by_axis(self, grid: Any) -> dict[str, int]:
        """Bytes per grid axis (x, y, z, data; "all" for the world and tensor groups)."""
        names = {id(grid.group(a)): a for a in ("x", "y", "z", "data") if grid.size(a) > 1}
        # an axis may have a second group of its own for prefetching gathers (z)
        names.update({id(grid.gather_group(a)): a for a in ("x", "y", "z", "data")
                      if grid.size(a) > 1})
        out = {"x": 0, "y": 0, "z": 0, "data": 0, "all": 0}
        for _, group, nbytes, _ in self.records:
            out[names.get(id(group), "all")] += nbytes
        return out

    def calls(self, grid: Any, axis: str, op: str | None = None) -> int:
        groups = (grid.group(axis), grid.gather_group(axis))
        return sum(1 for o, group, _, _ in self.records
                   if any(group is g for g in groups) and (op is None or o == op))
