"""What the main rank prints while training: a tqdm bar on a terminal, plain log lines when
the output goes to a file or a pipe."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm


class Progress:
    """Progress output of the main rank; on other ranks every method does nothing."""

    def __init__(self, total_steps: int, start_step: int, log_every: int, *, enabled: bool,
                 bar: bool | None = None, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.log_every = log_every
        self.stream = stream or sys.stderr
        if bar is None:
            bar = self.stream.isatty()
        self._bar: Any = None
        if enabled and bar:
            self._bar = tqdm(total=total_steps, initial=start_step, file=self.stream,
                             unit="step", dynamic_ncols=True)

    def step(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
             mfu: float | None) -> None:
        """Called after every step with the latest numbers."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            return
        if step % self.log_every == 0 or step == self.total:
            mfu_text = f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""
            self.message(f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | "
                         f"grad_norm {grad_norm:.3f} | {tokens_per_s:,.0f} tok/s{mfu_text}")

    def message(self, text: str) -> None:
        """A line of text that does not break the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
