"""Ctrl-C and SIGTERM in a training process.

SIGINT (Ctrl-C) interrupts at once: a KeyboardInterrupt, which the command turns into one line
and exit code 130. SIGTERM (what Slurm sends before preemption or at the time limit, and what
a launcher forwards) asks the run to stop after the current step: the trainer sees
`terminated`, the ranks agree on it, write a checkpoint and stop with `Stopped` (one line,
exit code 143); the next `fourfold train RUN_DIR` resumes from it. A second SIGTERM ends the
process at once. A launcher that passes on the signal its job received (torchrun, fourfold's
own, Slurm signalling every process of the step) delivers it twice within moments: a repeat
within REPEAT_WINDOW_S counts as the same signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

from fourfold.errors import FourfoldError

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
REPEAT_WINDOW_S = 2.0


class Stopped(FourfoldError):
    """A run that stopped on SIGTERM after writing a checkpoint; the message says where."""

    exit_code = EXIT_TERMINATED


class StopSignals:
    """This process's handlers for SIGINT and SIGTERM while it trains (`install`), and what
    they have seen."""

    def __init__(self) -> None:
        self.interrupted = False  # SIGINT: a KeyboardInterrupt was raised
        self.terminated_at: float | None = None  # SIGTERM: when (time.monotonic) it came
        self._previous: dict[int, object] = {}

    @property
    def terminated(self) -> bool:
        return self.terminated_at is not None

    @property
    def any(self) -> bool:
        """Whether a signal asked this process to stop (what it does on the way out is a
        consequence, not an error of its own)."""
        return self.interrupted or self.terminated

    def install(self) -> None:
        """Handle both signals in this process (from its main thread; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in ((signal.SIGINT, self._on_interrupt),
                                (signal.SIGTERM, self._on_terminate)):
            self._previous.setdefault(signum, signal.signal(signum, handler))

    def uninstall(self) -> None:
        """Put back the handlers `install` replaced (a process that goes on, such as a test)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted:
            return  # one KeyboardInterrupt unwinds the run; a repeat would cut that short
        self.interrupted = True
        raise KeyboardInterrupt

    def _on_terminate(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.terminated_at is None:
            self.terminated_at = now
        elif now - self.terminated_at > REPEAT_WINDOW_S:  # a second signal: stop at once
            sys.stderr.write("terminated\n")
            sys.stderr.flush()
            os._exit(EXIT_TERMINATED)
