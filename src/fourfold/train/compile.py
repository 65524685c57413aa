"""train.compile: torch.compile on each transformer block, with a way back to eager.

Compile errors surface at the first call, not at compile(): the first step runs under
`first_step`, which falls back to eager (with a warning) and runs the step again. Decoding
token by token with a growing cache would recompile the blocks for every new length, so
sampling runs them eagerly for a while (`eager`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from torch import nn

from fourfold.errors import first_line

T = TypeVar("T")


class BlockCompiler:
    """The compiled blocks of one model: each block of `module.layers` (the whole module when
    it has none) compiled in place by nn.Module.compile, so that the engine's hooks on the
    modules around them stay outside the compiled regions."""

    def __init__(self, module: nn.Module, enabled: bool) -> None:
        self.blocks: list[nn.Module] = []
        self.pending = enabled  # compiled, but no step has run yet
        if enabled:
            self.blocks = list(getattr(module, "layers", [])) or [module]
            for block in self.blocks:
                block.compile()

    @property
    def active(self) -> bool:
        """Whether the blocks run compiled (False when compile is off or fell back)."""
        return bool(self.blocks)

    def first_step(self, step: Callable[[], T], undo: Callable[[], None],
                   passthrough: tuple[type[BaseException], ...] = ()) -> T:
        """Run `step` (the first one since compiling). Should it fail with anything but a
        `passthrough` error, fall back to eager, call `undo` (what the failed attempt changed,
        such as gradients and the data loader's position) and run `step` again."""
        if not self.pending:
            return step()
        try:
            result = step()
        except passthrough:
            raise
        except Exception as error:  # a compile error, surfacing at the first call
            self.fall_back(error)
            undo()
            result = step()
        self.pending = False
        return result

    def fall_back(self, error: BaseException) -> None:
        """Run the blocks eagerly from now on, with a warning that names `error`."""
        first = first_line(str(error))
        warnings.warn(f"torch.compile failed ({type(error).__name__}: {first}); training "
                      "without compile", stacklevel=3)
        for block in self.blocks:
            _set_compiled_call(block, None)
        self.blocks = []
        self.pending = False

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Run the compiled blocks uncompiled inside the block."""
        saved = [(block, _compiled_call(block)) for block in self.blocks]
        for block, _ in saved:
            _set_compiled_call(block, None)
        try:
            yield
        finally:
            for block, impl in saved:
                _set_compiled_call(block, impl)


# nn.Module.compile() stores the compiled call in a private attribute and offers no public way
# to undo it; these two functions are the only places that touch it.
def _compiled_call(block: nn.Module) -> Callable[..., object] | None:
    return block._compiled_call_impl


def _set_compiled_call(block: nn.Module, impl: Callable[..., object] | None) -> None:
    block._compiled_call_impl = impl


__all__ = ["BlockCompiler"]
