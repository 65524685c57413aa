"""What the main rank prints while training: the run's header, a tqdm bar on a terminal, plain
log lines with the elapsed time and the time left when the output goes to a file or a pipe."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from tqdm import tqdm

from fourfold.config import Config


def describe_run(cfg: Config, grid: str, device: str, tokens_per_step: int, data: Path | str,
                 parameters: int, trainable: int) -> list[str]:
    """The header lines of a run: what is trained (model, size, method, adapter and its
    trainable parameters, the checkpoint it starts from), where (grid, device, dtype), on what
    (steps, tokens, data); then a warning for a setting that defeats itself."""
    t, a = cfg.train, cfg.adapter
    what = f"{cfg.model.preset} model ({parameters / 1e6:.1f}M parameters)"
    if cfg.model.init_from:
        what += f" from {cfg.model.init_from}"
    how = f"optimizer {t.optimizer}"
    if a.kind != "none":
        adapter = f"LoRA r={a.r} on {','.join(a.targets)}" if a.kind == "lora" else "norm gains"
        how += (f", adapter {adapter}: {trainable / 1e6:.2f}M trainable parameters "
                f"({100 * trainable / max(parameters, 1):.2f}%)")
    lines = [f"fourfold: {what}, {how}, grid {grid}, {device}, {t.dtype}, {t.steps} steps of "
             f"{tokens_per_step:,} tokens, data {data}; logged loss: the mean over the steps "
             "since the previous line"]
    if t.warmup_steps > t.steps:
        lines.append(f"warning: train.warmup_steps = {t.warmup_steps} is more than train.steps "
                     f"= {t.steps}: the learning rate never reaches train.lr = {t.lr:g}")
    return lines


def format_seconds(seconds: float) -> str:
    """1:02 for 62 s, 1:01:02 for 3662 s (tqdm's format)."""
    return str(tqdm.format_interval(seconds))


class Progress:
    """Progress output of the main rank; on other ranks every method does nothing.

    The time left counts from the end of the first step of this process (`first_step`), whose
    compilation and warm-up would otherwise inflate it; it covers everything the loop does
    between the steps (validation, checkpoints) at the rate seen so far."""

    def __init__(self, total_steps: int, start_step: int, log_every: int, *, enabled: bool,
                 bar: bool | None = None, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.log_every = log_every
        self.stream = stream or sys.stderr
        self._clock = clock
        self._started = clock()
        self._rate_from = (start_step, self._started)  # (step, time) the time left counts from
        if bar is None:
            bar = self.stream.isatty()
        self._bar: Any = None
        if enabled and bar:
            self._bar = tqdm(total=total_steps, initial=start_step, file=self.stream,
                             unit="step", dynamic_ncols=True)

    def first_step(self, step: int, seconds: float) -> None:
        """Called after the first step this process ran, which took `seconds`."""
        self._rate_from = (step, self._clock())
        self.message(f"first step (compiles/warms up) took {seconds:.1f} s")

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None,
             tokens_per_s: float, mfu: float | None, *, loss_steps: int = 1) -> None:
        """Called after every step with the latest numbers: `loss` is the mean of the last
        `loss_steps` steps' losses; a grad_norm of None or NaN (a method without one) is left
        out of the line."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            return
        if step % self.log_every == 0 or step == self.total:
            fields = [f"step {step}/{self.total}",
                      f"loss {loss:.4f}" + (f" (mean of {loss_steps})" if loss_steps > 1 else ""),
                      f"lr {lr:.2e}"]
            if grad_norm is not None and math.isfinite(grad_norm):
                fields.append(f"grad_norm {grad_norm:.3f}")
            fields.append(f"{tokens_per_s:,.0f} tok/s")
            if mfu is not None:
                fields.append(f"mfu {100 * mfu:.1f}%")
            fields.append(self._timing(step))
            self.message(" | ".join(fields))

    def _timing(self, step: int) -> str:
        now = self._clock()
        text = f"{format_seconds(now - self._started)} elapsed"
        from_step, from_time = self._rate_from
        if step >= self.total:
            return text
        if step > from_step:
            left = (now - from_time) / (step - from_step) * (self.total - step)
            text += f", ETA {format_seconds(left)}"
        return text

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
