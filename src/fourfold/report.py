"""`fourfold report RUN_DIR`: PNG plots of a run's metrics.jsonl (loss, validation loss,
tokens/s, memory) in RUN_DIR/report/.

Plots are drawn on a bare matplotlib Figure (the Agg canvas), never through pyplot, so that
making a report neither needs a display nor changes matplotlib's global backend.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fourfold.errors import FourfoldError
from fourfold.train.runs import METRICS_FILE

REPORT_DIR = "report"


class ReportError(FourfoldError, ValueError):
    """A run directory without usable metrics; the message is one line for the user."""


@dataclass(frozen=True)
class PlotSpec:
    """One plot: the metrics.jsonl keys that may hold its values (the first present wins)."""

    file: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    scale: float = 1.0  # values are divided by this (bytes -> GiB)
    log_y: bool = False


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("loss.png", "training loss", "loss", ("loss", "train_loss")),
    PlotSpec("val_loss.png", "validation loss", "loss", ("val_loss", "eval_loss")),
    PlotSpec("tokens_per_s.png", "throughput", "tokens/s",
             ("tokens_per_s", "tokens_per_sec", "tok_per_s")),
    PlotSpec("memory.png", "peak memory", "GiB",
             ("peak_mem_bytes", "peak_memory_bytes", "memory_bytes"),
             scale=2.0 ** 30),
)


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The JSON records of RUN_DIR/metrics.jsonl; a torn last line (a run killed mid-write) is
    skipped, any other bad line is an error."""
    path = Path(run_dir) / METRICS_FILE
    if not Path(run_dir).is_dir():
        raise ReportError(f"run directory {str(run_dir)!r} does not exist")
    if not path.is_file():
        raise ReportError(f"{path} does not exist; train the run first (it writes metrics "
                          "as it goes)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ReportError(f"{path}:{number}: not a JSON object") from None
        if isinstance(record, dict):
            records.append(record)
    if not records:
        raise ReportError(f"{path} holds no metrics yet")
    return records


def series(records: list[dict[str, Any]], keys: tuple[str, ...]) -> tuple[str, list[float],
                                                                           list[float]]:
    """(key, steps, values) for the first of `keys` that any record holds with a finite number;
    records without a step are numbered in order."""
    for key in keys:
        steps: list[float] = []
        values: list[float] = []
        for index, record in enumerate(records):
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            step = record.get("step", index)
            steps.append(float(step) if isinstance(step, (int, float)) else float(index))
            values.append(float(value))
        if values:
            return key, steps, values
    return "", [], []


def write_report(run_dir: Path) -> list[Path]:
    """Write one PNG per metric found in RUN_DIR/metrics.jsonl into RUN_DIR/report/; returns
    their paths. Raises ReportError when there is nothing to plot."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = read_records(run_dir)
    out_dir = run_dir / REPORT_DIR
    written: list[Path] = []
    for spec in PLOTS:
        key, steps, values = series(records, spec.keys)
        if not values:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        fig = Figure(figsize=(6.4, 4.0), dpi=100)
        ax = fig.add_subplot()
        ax.plot(steps, [v / spec.scale for v in values], marker="." if len(values) < 50 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(spec.ylabel)
        ax.set_title(f"{spec.title} ({run_dir.name})")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = out_dir / spec.file
        fig.savefig(path)
        written.append(path)
    if not written:
        known = ", ".join(k for spec in PLOTS for k in spec.keys[:1])
        raise ReportError(f"{run_dir / METRICS_FILE} has none of the plotted metrics ({known})")
    return written
