"""The parts of the training loop that say when they are due: `Periodic` (validation, samples,
checkpoints: every N steps, and at the end where asked) and `RunLog` (the progress output,
metrics.jsonl and the straggler report, at the logged steps). Trainer.fit asks each after
every step and reads the step's numbers from the device only when one is due.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fourfold.config import Config
from fourfold.models.llama import flops_per_token
from fourfold.parallel import ParallelModel
from fourfold.plan.perf import hardware_flops_per_token
from fourfold.train.methods import TrainingMethod
from fourfold.train.metrics import LogWindow, MetricsLog, job_peak_flops, peak_memory_bytes
from fourfold.train.progress import Progress
from fourfold.train.resilience import gather_step_times, straggler_report
from fourfold.train.runs import METRICS_FILE
from fourfold.train.trackers import open_trackers


@dataclass(frozen=True)
class Periodic:
    """A part of the loop that runs every `every` steps (0: never) of a run of `steps`; at the
    last step also where `at_end`, never where `not_at_end` (the end of the run does it)."""

    every: int
    steps: int
    run: Callable[[int], None]  # given the step just taken
    at_end: bool = False
    not_at_end: bool = False

    def due(self, step: int) -> bool:
        if step == self.steps and (self.at_end or self.not_at_end):
            return self.at_end
        return self.every > 0 and step % self.every == 0


class RunLog:
    """What a run reports as it trains: on the main rank the progress output (a bar on a
    terminal, lines otherwise) and metrics.jsonl (and the experiment trackers of
    logging.trackers); on every rank the numbers behind a logged step's record and its
    straggler report (collective: every rank logs the same steps). Throughput, MFU and the
    logged mean loss are over the steps since the last logged one (a LogWindow)."""

    def __init__(self, cfg: Config, run_dir: Path, pmodel: ParallelModel,
                 method: TrainingMethod, start_step: int, is_main: bool,
                 bar: bool | None) -> None:
        t = cfg.train
        self.cfg, self.pmodel, self.method = cfg, pmodel, method
        self.device = pmodel.grid.device
        self.is_main = is_main
        self.metrics = (MetricsLog(run_dir / METRICS_FILE,
                                   open_trackers(cfg, run_dir, resuming=start_step > 0),
                                   append=start_step > 0) if is_main else None)
        self.progress = Progress(t.steps, start_step, t.log_every, enabled=is_main, bar=bar)
        self.tokens_per_step = t.batch_size * t.seq_len
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.hardware_flops_per_token = hardware_flops_per_token(
            cfg.model, t.seq_len, t.activation_checkpointing)
        # the whole job's peak, as the planner's MFU counts it (one hardware catalog); none for
        # a simulated rank, whose steps' times are those of fake tensors (and whose matmuls
        # would make a probe of this host meaningless)
        grid = pmodel.grid
        self.peak_flops = (job_peak_flops(self.device, t.dtype, grid.world_size)
                           if is_main and not grid.simulated else None)
        self._peak_refreshed = False
        self.window = LogWindow()  # the steps since the last logged one
        self._first = True

    def due(self, step: int) -> bool:
        """Whether `step` is logged (a skipped step is too, once it is known)."""
        t = self.cfg.train
        return step % t.log_every == 0 or step == t.steps

    def message(self, text: str) -> None:
        self.progress.message(text)

    def stepped(self, stats: Any) -> None:
        """After every step, before its numbers are read: the first step's (host) time, which
        its compilation and warm-up make long; waiting for the device here would cost the
        steps that follow."""
        if self._first:
            self._first = False
            self.progress.first_step(stats.step, stats.seconds)

    def record(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl (the main rank's)."""
        if self.metrics is not None:
            self.metrics.write(record)

    def step(self, stats: Any) -> None:
        """A step whose numbers are read: the progress output, and when it is logged its record
        and the straggler report (collective)."""
        window = self.window
        window.add(self.tokens_per_step, stats.seconds,
                   math.nan if stats.skipped else stats.loss)
        tokens_per_s = window.tokens_per_s
        mfu = self.mfu(tokens_per_s)
        self.progress.step(stats.step, window.mean_loss, stats.lr, stats.grad_norm,
                           tokens_per_s, mfu, loss_steps=window.loss_steps)
        if stats.skipped:
            self.message(f"step {stats.step}: {stats.reason}: update skipped "
                         "(train.nan_policy = \"skip\")")
        if stats.skipped or self.due(stats.step):
            self._write_step(stats, tokens_per_s, mfu, window.mean_loss)
            self._report_stragglers(stats)
            window.reset()

    def mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak_flops:
            return None
        mfu = self.flops_per_token * tokens_per_s / self.peak_flops
        if mfu > 1.0 and self.device.type == "cpu" and not self._peak_refreshed:
            # the cached probe was taken on a busy machine: measure again (keeps the max)
            self._peak_refreshed = True
            t = self.cfg.train
            self.peak_flops = job_peak_flops(self.device, t.dtype, self.pmodel.grid.world_size,
                                             refresh=True) or self.peak_flops
            mfu = self.flops_per_token * tokens_per_s / self.peak_flops
        return mfu

    def _write_step(self, stats: Any, tokens_per_s: float, mfu: float | None,
                    mean_loss: float) -> None:
        # Every rank reads its own ledger, but only the main rank writes: its numbers stand for
        # the per-rank traffic (all ranks of one grid shape move the same bytes per axis).
        comm = self.pmodel.ledger.snapshot()
        if self.metrics is None:
            return
        t = self.cfg.train
        record: dict[str, Any] = {
            "step": stats.step, "loss": stats.loss, "loss_mean": mean_loss, "lr": stats.lr,
            "grad_norm": stats.grad_norm, "tokens_per_s": tokens_per_s, "mfu": mfu,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "comm_bytes_x": comm.get("x", 0), "comm_bytes_y": comm.get("y", 0),
            "comm_bytes_z": comm.get("z", 0), "comm_bytes_data": comm.get("data", 0),
            "param_bytes": self.pmodel.memory_bytes()["params"],
            "grad_bytes": self.method.peak_grad_bytes,
            "optimizer_bytes": self.method.state_bytes(), "step_seconds": stats.seconds,
        }
        if t.activation_checkpointing and mfu is not None:
            # hardware FLOPs: the recomputed forward counted too, as the planner's HFU
            record["hfu"] = mfu * self.hardware_flops_per_token / self.flops_per_token
        if t.loss == "goldfish":
            record["loss_token_fraction"] = stats.token_fraction
        if not math.isfinite(stats.grad_norm) and not stats.skipped:
            del record["grad_norm"]  # lomo, adalomo: no norm without clip_mode "two_pass"
        if not math.isfinite(mean_loss):
            del record["loss_mean"]  # every step of the window was skipped
        if stats.skipped:
            record["skipped"] = True
            record["skip_reason"] = stats.reason
        self.metrics.write(record)

    def _report_stragglers(self, stats: Any) -> None:
        """All-gather every rank's step time and name the ranks much slower than the rest."""
        if self.pmodel.grid.world_size == 1:
            return
        times = gather_step_times(stats.seconds, self.pmodel.comm)
        line = straggler_report(times)
        if line is None:
            return
        self.message(f"step {stats.step}: {line}")
        self.record({"event": "straggler", "step": stats.step, "step_seconds": times,
                     "message": line})

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()


__all__ = ["Periodic", "RunLog"]
