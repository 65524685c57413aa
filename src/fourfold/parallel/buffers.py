"""A pool of one released gradient buffer, for the engine's next weight gradient of its shape.

A training method that updates each weight at its hand-off and frees its gradient (LOMO,
AdaLomo, GaLore, BlockLLM's copied rows) gives the buffer back (Engine.release_grad); the
engine writes the next gradient of that shape and dtype into it (a dW GEMM's output, a cast
block) instead of allocating anew. Where fresh allocations are cheap and reused by the
allocator itself (a GPU's caching allocator) there is no pool; the run's memory policy makes
one where they are not (train/host_memory.py says why, tests/test_engine_single.py checks the
reuse).
"""

from __future__ import annotations

import torch


class GradBufferPool:
    """Keeps the largest released gradient buffer (one at a time) until a gradient of its
    shape asks for it."""

    def __init__(self) -> None:
        self._spare: torch.Tensor | None = None
        # the dtypes each gradient shape has been asked for in: a shape asked for in another
        # dtype than its gradient's is made in that dtype and cast (the blocked loss's
        # bfloat16 dW), and its buffer would only sit beside it, so it is not kept
        self._asked: dict[tuple[int, ...], set[torch.dtype]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor | None:
        """The kept buffer where it fits `shape` on `device` (once), else None. Of another
        dtype it is dropped, and that shape is not kept again."""
        self._asked.setdefault(tuple(shape), set()).add(dtype)
        spare = self._spare
        if spare is None or tuple(spare.shape) != tuple(shape) or spare.device != device:
            return None
        self._spare = None
        return spare if spare.dtype == dtype else None

    def give(self, grad: torch.Tensor) -> None:
        """Keep `grad`'s buffer, where it is a tensor of its own storage, of a shape not asked
        for in another dtype, and at least as large as the one kept. The caller keeps no
        reference to it."""
        if (grad.is_contiguous() and grad.storage_offset() == 0
                and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
                and self._asked.get(tuple(grad.shape), {grad.dtype}) == {grad.dtype}
                and (self._spare is None or grad.numel() * grad.element_size()
                     >= self._spare.numel() * self._spare.element_size())):
            self._spare = grad
