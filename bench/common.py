"""What every bench shares: its argument parser, one header and markdown tables.

Every bench prints the same shape of output, so that a run can be pasted into
docs/results.md as it is:

    ## <the question the bench answers>
    date YYYY-MM-DD · machine (CPU or GPU, cores, memory) · torch VERSION · commit SHORT-HASH
    command: python bench/comm.py --nproc 4

    | grid | x MiB | ... |
    |---|---|---|
    | ... |

Rows are printed as they are measured (a long bench shows its progress), and a bench that
cannot run says why in one `error: ...` line with a non-zero exit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose description is the bench's docstring."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def fail(message: str) -> NoReturn:
    """Stop the bench with one line for the user."""
    sys.exit(f"error: {message}")


def machine() -> str:
    """This host in a few words: the GPU torch sees, else the CPU; cores and memory."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    words = [cpu, f"{os.cpu_count()} cores"]
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        words.append(f"{pages / 2**30:.0f} GiB")
    except (ValueError, OSError, AttributeError):
        pass
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            words.insert(0, f"{n} x {torch.cuda.get_device_name(0)}")
    return ", ".join(words)


def commit() -> str:
    """The checkout's commit, with `+changes` when the work tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def header(question: str, notes: str = "", command: str | None = None) -> None:
    """The bench's title, when and where it ran, and the command that repeats it (by default
    this script's own command line)."""
    import torch

    date = datetime.date.today().isoformat()
    print(f"## {question}")
    print(f"date {date} · machine {machine()} · torch {torch.__version__} · commit {commit()}")
    if command is None:
        script = os.path.relpath(sys.argv[0], ROOT)
        command = shlex.join(["python", script, *sys.argv[1:]])
    print("command: " + command)
    if notes:
        print(notes)
    print(flush=True)


class Table:
    """A markdown table printed row by row, as the rows are measured."""

    def __init__(self, *columns: str) -> None:
        self.columns = columns
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns), flush=True)

    def row(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in `text`, as {column: cell} (for tests)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2:
        return []
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(columns) or cells == columns:
            break  # the next table
        rows.append(dict(zip(columns, cells)))
    return rows


def parse_grid(text: str, flag: str = "--grid") -> tuple[int, int]:
    """An XxY grid given to `flag`, or exit with one line saying what is allowed."""
    try:
        x, y = (int(v) for v in text.lower().split("x"))
    except ValueError:
        fail(f"{flag} {text!r}: give it as XxY, for example 2x2")
    if x < 1 or y < 1:
        fail(f"{flag} {text!r}: x and y must be at least 1")
    return x, y


def mib(n: float, digits: int = 0) -> str:
    return f"{n / MIB:,.{digits}f}"


def job_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's rank variables (a bench that starts its own
    job must not join the one it may run in), plus `extra`."""
    rank_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in rank_vars}
    env.update(extra)
    return env
