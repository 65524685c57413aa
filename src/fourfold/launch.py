"""Start N local ranks of a `fourfold` command with torch's elastic launcher (what torchrun
uses), so that `fourfold train --nproc 4` needs no separate launcher on one machine.

Each rank runs `python -m fourfold ARGV...` with the usual torchrun variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); the ranks' output goes straight to this
terminal. The launcher restarts the whole group up to `max_restarts` times when a rank fails.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from fourfold.errors import first_line
from fourfold.host import threads_per_rank

# Set in the environment of the ranks that launch_local starts: they leave error messages to
# the launcher's summary line instead of printing them.
LAUNCHED_BY_FOURFOLD = "FOURFOLD_LOCAL_LAUNCH"


def write_error_file(message: str) -> bool:
    """In a rank started by an elastic launcher, record `message` in the rank's error file
    (TORCHELASTIC_ERROR_FILE), where the launcher's ChildFailedError finds it. Returns whether
    there was such a file to write."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except OSError:
        return False
    return True


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the ranks (they inherit ours) and restore them after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Hide the elastic agent's own log lines (it announces every SIGTERM it sends and repeats
    each failure); the ranks' output and our one-line summary say what happened. Its modules'
    loggers set levels of their own, so each is quieted, not just the parent."""
    names = [name] + [n for n in logging.root.manager.loggerDict if n.startswith(name + ".")]
    loggers = [logging.getLogger(n) for n in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, saved):
            logger.setLevel(level)


STOP_GRACE_S = 600  # how long ranks may take to finish a step and checkpoint after SIGTERM


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0,
                 rdzv_timeout_s: int = 300) -> int:
    """Run `python -m fourfold *argv` on `nproc` local ranks; return 0 when every rank exited
    with 0, else the first failed rank's exit code (after printing one line naming it)."""
    # Imported here: the elastic launcher pulls in a lot that `fourfold --help` does not need.
    import torch
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from fourfold.host import rank_malloc_environment

    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be at least 1")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts {max_restarts}: must not be negative")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        # c10d rendezvous on port 0: the store binds a free localhost port itself, so two jobs
        # started at once cannot pick the same one (a probe-then-bind port could race).
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": rdzv_timeout_s},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(),
        # a SIGTERM passed on to the ranks has them finish the step and write a checkpoint
        shutdown_timeout=STOP_GRACE_S,
    )
    # -u: rank output reaches the terminal line by line, not when a buffer fills.
    entrypoint_args = ["-u", "-m", "fourfold", *argv]
    env = {"OMP_NUM_THREADS": str(threads_per_rank(nproc)), LAUNCHED_BY_FOURFOLD: "1",
           # Elastic shares one TCPStore across restarts by default; restarted gloo ranks
           # then read the dead ranks' addresses from it and fail (connection refused).
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if not torch.cuda.is_available():  # CPU ranks: a heap that reuses, and coalesces
        env.update(rank_malloc_environment())
    try:
        with _environment(env), _quiet_logger("torch.distributed.elastic"):
            elastic_launch(config, sys.executable)(*entrypoint_args)
    except SignalException as stop:  # the launcher's own SIGINT / SIGTERM, passed to ranks
        if stop.sigval == signal.SIGINT:
            print("interrupted", file=sys.stderr, flush=True)  # the ranks leave it to us
        return 128 + int(stop.sigval)  # after SIGTERM rank 0 said where its checkpoint is
    except ChildFailedError as failure:
        code = first_exit_code(failure)
        if code == 128 + signal.SIGINT:
            print("interrupted", file=sys.stderr, flush=True)
        elif code != 128 + signal.SIGTERM:  # rank 0 said where its checkpoint is
            print(f"error: {describe_failure(failure)}", file=sys.stderr, flush=True)
        return code
    return 0


def describe_failure(failure: object) -> str:
    """One line naming the failed rank(s), exit code(s) and message(s) of an elastic
    ChildFailedError; ranks that failed the same way share one clause.

    Ranks the launcher itself stopped (SIGTERM after another rank failed) are left out when a
    rank failed on its own: they are a consequence, not the cause.
    """
    failures = getattr(failure, "failures", {}) or {}
    if not failures:
        return f"a rank failed: {failure}"
    causes = [r for r in sorted(failures) if not _stopped_by_launcher(failures[r].exitcode)]
    groups: dict[str, list[int]] = {}
    for rank in causes or sorted(failures):
        groups.setdefault(_describe_outcome(failures[rank]), []).append(rank)
    clauses = [f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} {what}"
               for what, ranks in groups.items()]
    if len(clauses) > 2:
        return f"{clauses[0]}; {clauses[1]}; and {len(clauses) - 2} more"
    return "; ".join(clauses)


def _stopped_by_launcher(exitcode: int | None) -> bool:
    return exitcode is not None and -exitcode in (signal.SIGTERM, signal.SIGKILL)


def _describe_outcome(failure: object) -> str:
    code = getattr(failure, "exitcode", None)
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"killed by signal {name}"
    raw = getattr(failure, "message", "") or ""
    message = first_line(str(raw.get("message", "") if isinstance(raw, dict) else raw))
    # Without an error file elastic fills `message` with a hint about @record, which says
    # nothing about this failure.
    detail = "" if not message or "pytorch.org/docs" in message else f": {message}"
    return f"exited with code {code}{detail}"


def first_exit_code(failure: object) -> int:
    """The exit code to return for a failed launch: the first failing rank's own code, or
    128 + signal for a rank killed by a signal, or 1."""
    failures = getattr(failure, "failures", {}) or {}
    codes = [failures[r].exitcode for r in sorted(failures)]
    for code in codes:
        if code is not None and code > 0:
            return code
    for code in codes:
        if code is not None and code < 0 and not _stopped_by_launcher(code):
            return 128 - code
    return 1
