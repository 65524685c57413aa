"""The training loop: one code path from one CPU process to a 4D grid of GPUs.

    cfg -> build_run (train/build.py: grid, model, parallelize, training method, loaders)
        -> Run -> Trainer.from_run(run).fit()          (Trainer(cfg, run_dir) does both)

Every step fetches the whole step's batch for this rank, splits it into train.grad_accum
micro-batches, normalizes the loss by the number of counted tokens in the whole job's step
(exact against a single process for every grid shape and accumulation) and hands them to the
training method (train/methods), which runs the forwards and backwards and updates the
weights. After each step the loop asks its parts whether they are due (train/loop.py: the log,
validation, samples, checkpoints); the end of the run (export, final sample, summary) is
`finish`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from fourfold.config import Config
from fourfold.data import Batch, Tokenizer
from fourfold.errors import EXIT_FAILED, FourfoldError
from fourfold.models.adapter import apply_adapter, write_adapter_run
from fourfold.models.llama import Llama, build_model
from fourfold.parallel import Grid, ParallelModel
from fourfold.parallel.grid import check_shared_directory
from fourfold.plan.memory import predicted_memory
from fourfold.rundir import resume_point, run_identity, save_run_tokenizer, step_of
from fourfold.signals import StopSignals, Stopped
from fourfold.train.build import Run, build_run
from fourfold.train.checkpoint import (BaseReference, CheckpointError, CheckpointManager,
                                       ModelState)
from fourfold.train.memory_report import MemoryMeter, gather_reports, predicted_report
from fourfold.train.methods import StepData, TrainingMethod
from fourfold.train.loop import Periodic, RunLog
from fourfold.train.metrics import peak_memory_bytes
from fourfold.train.optim import LRSchedule
from fourfold.train.progress import describe_run
from fourfold.train.resilience import (FINE, DeviceJudgement, LossGuard, UpdateGate,
                                       restart_count, resume_record)
from fourfold.train.runs import (CONFIG_FILE, SAMPLES_FILE, WEIGHTS_FILE,
                                 save_weights_streamed, write_summary)
from fourfold.train.sampling import generate, generate_on_grid
from fourfold.train.stopping import StopAgreement

SAMPLE_PROMPT_TOKENS = 16
SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 40
# train.nan_policy = "rollback" gives up after this many rollbacks to the same checkpoint.
MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3


class TrainingError(FourfoldError, RuntimeError):
    """Training cannot go on (a NaN loss under nan_policy = "stop"); one line for the user."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def stop_error(step: int, reason: str) -> TrainingError:
    """What ends a run under train.nan_policy = "stop"."""
    return TrainingError(f"step {step}: {reason}; stopped (train.nan_policy = \"stop\"); try a "
                         "lower train.lr or train.nan_policy = \"skip\"", step)


class StepStats:
    """One step's numbers. Those a method judged on the device (AdamW's loss, gradient norm and
    verdict) stay there until first read (`read_steps` reads several steps in one transfer),
    so that a step that is not logged never waits for the device."""

    def __init__(self, step: int, lr: float, seconds: float, *,
                 device_values: torch.Tensor | None = None,
                 host_values: tuple[float, float, bool, str, float] | None = None,
                 guard: LossGuard | None = None) -> None:
        self.step, self.lr, self.seconds = step, lr, seconds
        # device_values: float64 (6,) = loss, grad_norm, verdict code, running mean, applied,
        # counted tokens / all tokens; host_values: (loss, grad_norm, skipped, reason, fraction)
        self._device_values = device_values
        self._host = host_values
        self._guard = guard

    def _set_read(self, values: list[float]) -> None:
        loss, grad_norm, code, mean, applied, fraction = values
        # a simulated rank's fake numbers read as NaN (fourfold.simulate): no verdict, applied
        verdict = int(code) if math.isfinite(code) else FINE
        reason = "" if self._guard is None else self._guard.reason(
            verdict, loss, grad_norm, mean) or ""
        if not applied and not reason:
            reason = ("an earlier step was bad (train.nan_policy = \"stop\" keeps its weights "
                      "until the host sees it)")
        self._host = (loss, grad_norm, not applied, reason, fraction)
        self._device_values = None

    def _read(self) -> tuple[float, float, bool, str, float]:
        if self._host is None:
            read_steps([self])
        assert self._host is not None
        return self._host

    @property
    def loss(self) -> float:
        return self._read()[0]

    @property
    def grad_norm(self) -> float:
        return self._read()[1]

    @property
    def skipped(self) -> bool:
        return self._read()[2]

    @property
    def reason(self) -> str:  # why the step was bad (NaN/inf, spike), when it was
        return self._read()[3]

    @property
    def token_fraction(self) -> float:  # counted tokens / all tokens (below 1 with goldfish)
        return self._read()[4]


def read_steps(steps: list[StepStats]) -> None:
    """Bring the device numbers of `steps` to the host in one transfer (one wait)."""
    waiting = [s for s in steps if s._host is None and s._device_values is not None]
    if not waiting:
        return
    rows = torch.stack([s._device_values for s in waiting]).tolist()  # type: ignore[misc]
    for s, row in zip(waiting, rows):
        s._set_read(row)


def time_completed_steps(steps: list[StepStats], started: float, device: torch.device) -> None:
    """Give `steps` (run back to back since `started`) their share of the wall clock until the
    device has finished them. A step's own timer stops when the host has queued its work, which
    on a GPU is long before the work is done: tokens/s, MFU and the straggler report read the
    completed time instead."""
    read_steps(steps)  # waits for the device's numbers of the last step
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # and for its update, queued after them
    seconds = (time.perf_counter() - started) / max(len(steps), 1)
    for s in steps:
        s.seconds = seconds


@dataclass
class TrainResult:
    final_loss: float
    val_loss: float | None  # the last validation loss, None when validation is off
    losses: list[float]  # one per step (NaN for a skipped step)
    val_losses: list[tuple[int, float]]  # (step, validation loss)
    run_dir: Path
    tokens_per_s: float
    steps: int
    time_s: float
    skipped_steps: list[int] = field(default_factory=list)


class Trainer:
    """Trains the parts of a Run: steps, validation, logging, samples, checkpoints, recovery.

    Usable alone from Python: `Trainer(cfg, run_dir).fit()` builds the run first (build_run),
    also with a model built elsewhere (`model=`, a fourfold Llama whose config matches
    cfg.model); `Trainer.from_run(build_run(cfg, run_dir))` takes parts built already. On a
    grid, every rank constructs a Trainer and calls the same methods in the same order
    (several of them are collective).
    """

    def __init__(self, cfg: Config, run_dir: str | Path, *, model: Llama | None = None,
                 progress: bool | None = None) -> None:
        self._adopt(build_run(cfg, run_dir, model=model), progress)

    @classmethod
    def from_run(cls, run: Run, *, progress: bool | None = None) -> Trainer:
        """A trainer over parts already built (resumes from run_dir's latest checkpoint when
        checkpoint.resume is on; collective on a grid)."""
        trainer = cls.__new__(cls)
        trainer._adopt(run, progress)
        return trainer

    def _adopt(self, run: Run, progress: bool | None) -> None:
        self.run = run
        self.cfg = run.cfg  # resolved (see build_run); written as RUN_DIR/config.toml
        self.run_dir = run.run_dir
        self.rank, self.world_size, self.device = run.rank, run.world_size, run.device
        self.grid: Grid = run.grid
        self.is_main = self.rank == 0
        self.data_dir = run.data_dir
        self.tokenizer: Tokenizer = run.tokenizer
        self.pmodel: ParallelModel = run.pmodel
        self.compiler = run.compiler
        self.method: TrainingMethod = run.method
        self.loader, self.val_loader = run.loader, run.val_loader
        self.guard = run.guard
        self.gate = UpdateGate(self.guard, hold_after_bad=self.cfg.train.nan_policy == "stop")
        self.schedule = LRSchedule(self.cfg.train)
        self.memory_meter = (MemoryMeter(self.pmodel, self.method,
                                         self.cfg.train.activation_checkpointing)
                             if self.cfg.train.memory_report else None)
        t = self.cfg.train
        self._val_cache: list[Batch] | None = None

        self.step = 0
        self.tokens_per_step = t.batch_size * t.seq_len
        self.progress_choice = progress
        self.log: RunLog | None = None  # while fit runs
        self.losses: list[float] = []
        self.val_losses: list[tuple[int, float]] = []
        self.skipped_steps: list[int] = []
        self.train_seconds = 0.0

        # what the run must be to resume at all (checked against a checkpoint's manifest); a
        # simulated rank (torch's fake process group, fourfold.simulate) has no data directory
        self.identity = ({} if self.grid.simulated else run_identity(
            self.cfg, self.data_dir, self.cfg.data.tokenizer_fingerprint))
        self.checkpoints = self._checkpoint_manager()
        self.stop: StopAgreement | None = None  # asked after every step, when set
        self.resumed_from: Path | None = None
        self._rollbacks: tuple[Path | None, int] = (None, 0)  # (checkpoint, rollbacks to it)
        if self.cfg.checkpoint.resume:
            path = resume_point(self.checkpoints, self.identity)  # collective on a grid
            if path is not None:
                self._restore(path)
                self.resumed_from = path
        # the parts of the loop that run every so many steps, in this order after a step
        self.periodic = [
            Periodic(t.eval_every if t.eval_batches > 0 else 0, t.steps, self._validate,
                     at_end=t.eval_batches > 0),
            Periodic(t.sample_every, t.steps, self._sample, not_at_end=True),  # finish does
            Periodic(self.cfg.checkpoint.every, t.steps, lambda step: self.save_checkpoint()),
        ]

    def _checkpoint_manager(self) -> CheckpointManager:
        """The run's checkpoints, holding what a resumed run needs to go on exactly (the
        manager adds each rank's RNG states)."""
        manager = CheckpointManager(self.run_dir, self.cfg.checkpoint, self.grid)
        manager.identity = self.identity
        adapter = self.cfg.adapter.kind != "none"
        manager.register("model", ModelState(self.pmodel, trainable_only=adapter))
        manager.register("method", self.method.checkpoint_part(self.pmodel))
        for name, part in (("trainer", self), ("loader", self.loader), ("guard", self.guard),
                           ("schedule", self.schedule)):
            manager.register(name, part)
        if adapter:  # its checkpoints hold the adapter alone, and which base it belongs to
            manager.register("base", BaseReference(self.cfg.model.init_from,
                                                   self.cfg.train.seed))
        return manager

    # ---- building blocks ----------------------------------------------------------------

    def _autocast(self) -> torch.autocast:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.train.dtype == "bfloat16")

    def _loss_mask(self, batch: Batch) -> torch.Tensor:
        """1.0 where a target counts in the loss: a trained one (every target of raw text; the
        answers of chat data), unless the goldfish loss drops it."""
        t = self.cfg.train
        mask = batch.loss_weights()
        if t.loss == "goldfish":
            from fourfold.train.goldfish import goldfish_mask  # only runs that ask for it

            mask = mask * goldfish_mask(batch.inputs, batch.targets, t.goldfish_k,
                                        t.goldfish_h).float()
        return mask

    def _forward(self, batch: Batch) -> torch.Tensor:
        """Per-token losses (b, T) of a micro-batch; packed rows attend within documents."""
        with self._autocast():
            return self.pmodel(batch.inputs, batch.targets, documents=batch.documents)

    def _val_batches(self) -> list[Batch]:
        if self._val_cache is None:
            batches = self.val_loader.eval_batches(self.cfg.train.eval_batches)
            self._val_cache = [b.to(self.device) for b in batches]
        return self._val_cache

    # ---- one step -----------------------------------------------------------------------

    def train_step(self) -> StepStats:
        """One optimizer step (train.grad_accum micro-steps). Collective on a grid."""
        if not self.compiler.pending:
            return self._watched_step()
        loader_state = self.loader.state_dict()

        def undo() -> None:  # what a first step that failed to compile changed
            self.pmodel.module.zero_grad(set_to_none=True)
            self.loader.load_state_dict(loader_state)

        return self.compiler.first_step(self._watched_step, undo, passthrough=(TrainingError,))

    def _watched_step(self) -> StepStats:
        if self.memory_meter is None:
            return self._train_step()
        with self.memory_meter.step():  # train.memory_report
            return self._train_step()

    def _train_step(self) -> StepStats:
        start = time.perf_counter()
        step = self.step + 1
        lr = self.schedule.lr(step)
        self.pmodel.ledger.reset()
        data, global_count = self._step_data()
        self.gate.begin_step()
        result = self.method.step(self.pmodel, data, lr, self.gate)
        judged = self.gate.judgement
        if judged is None:  # a method that did not ask: judged after its update (a NaN norm
            norm = float(result.grad_norm)  # is one it does not know)
            self.gate.check(float(result.loss), None if math.isnan(norm) else norm)
            judged = self.gate.judgement
        fraction = global_count.double() / self.tokens_per_step
        if isinstance(judged, DeviceJudgement):
            v = judged.verdict
            self.step = step
            values = torch.stack([v.loss, v.grad_norm, v.code.double(), v.mean,
                                  judged.applied.double(), fraction])
            return StepStats(step, lr, time.perf_counter() - start, device_values=values,
                             guard=self.guard)
        assert judged is not None
        reason = judged.reason or (result.reason if result.skipped else None)
        if reason is not None and self.cfg.train.nan_policy == "stop":
            raise stop_error(step, reason)
        self.step = step
        return StepStats(step, lr, time.perf_counter() - start, host_values=(
            judged.loss, judged.grad_norm, reason is not None, reason or "", float(fraction)))

    def _step_data(self) -> tuple[StepData, torch.Tensor]:
        """This rank's share of the next step's batch, as the training method runs it: its
        micro-batches' losses, each normalized by the counted tokens of the whole job's step
        (returned too, on the device)."""
        t = self.cfg.train
        batch = self.loader.next_batch().to(self.device)  # (B / shards, T)
        micro = batch.split(t.grad_accum)
        masks = [self._loss_mask(b) for b in micro]
        local_count = torch.stack([m.sum() for m in masks]).sum()
        global_count = self._count_over_batch(local_count).clamp(min=1.0)

        def losses() -> Iterator[torch.Tensor]:
            for batch, mask in zip(micro, masks):
                per_token = self._forward(batch)  # (b, T)
                yield (per_token.float() * mask).sum() / global_count

        return StepData(len(micro), losses), global_count

    def _count_over_batch(self, local: torch.Tensor) -> torch.Tensor:
        """A token count summed over the axes the step's batch is split over (es: z only; its
        data replicas see the same batch)."""
        if tuple(self.method.batch_axes) == ("data", "z"):
            return self.pmodel.reduce_over_batch(local)
        total = local.detach().double().clone()
        for axis in self.method.batch_axes:
            if self.grid.size(axis) > 1:
                total = self.pmodel.comm.all_reduce(total, axis).wait()
        return total.to(local.dtype)

    # ---- evaluation and samples -----------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss per trained token over train.eval_batches fixed batches (the
        same batches every time), reduced over the batch axes. Collective on a grid."""
        module = self.pmodel.module
        was_training = module.training
        module.eval()
        try:
            loss_sum = torch.zeros((), device=self.device)
            count = torch.zeros((), device=self.device)
            micro_steps = self.cfg.train.grad_accum
            for batch in self._val_batches():
                for micro in batch.split(micro_steps):
                    weights = micro.loss_weights()
                    loss_sum += (self._forward(micro).float() * weights).sum()
                    count += weights.sum()
            totals = self.pmodel.reduce_over_batch(torch.stack([loss_sum, count]))
        finally:
            module.train(was_training)
        return float(totals[0] / totals[1].clamp(min=1.0))

    def _sample_prompt(self) -> list[int]:
        batches = self._val_batches() or [self.val_loader.eval_batches(1)[0].to(self.device)]
        return batches[0].inputs[0, :SAMPLE_PROMPT_TOKENS].tolist()

    def sample_text(self) -> str:
        """A continuation of a validation-text prompt by the model. Collective on a grid: every
        rank runs the forwards on its own shards (train/sampling.py generate_on_grid), so no
        rank holds the whole model; the text is rank 0's to record."""
        prompt = self._sample_prompt()
        t = self.cfg.train
        module = self.pmodel.module
        with self._autocast(), self.compiler.eager():
            if self.world_size == 1 and isinstance(module, Llama):
                new = generate(module, prompt, t.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                               top_k=SAMPLE_TOP_K, seed=t.seed,
                               vocab_size=self.tokenizer.vocab_size)
            else:
                new = generate_on_grid(self.pmodel, prompt, t.sample_tokens,
                                       temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K,
                                       seed=t.seed, vocab_size=self.tokenizer.vocab_size)
        return self.tokenizer.decode(prompt) + self.tokenizer.decode(new)

    def _can_sample(self) -> bool:
        return isinstance(self.pmodel.module, Llama)

    # ---- the run ------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Train to train.steps, then finish the run (`finish`: model.safetensors and
        summary.json in the run directory). After each step the loop asks its parts whether
        they are due (the log, then validation, samples and checkpoints: `periodic`) and
        reads the step's numbers from the device only when one is, or at once under
        nan_policy = "rollback", which must act on the very step that went bad."""
        t = self.cfg.train
        self._open_run_dir()
        self.log = RunLog(self.cfg, self.run_dir, self.pmodel, self.method, self.step,
                          self.is_main, self.progress_choice)
        started = time.perf_counter()
        try:
            self._announce()
            if t.eval_batches > 0 and t.eval_every > 0 and self.step == 0:
                self._validate(0)
            pending: list[StepStats] = []  # steps whose numbers are still on the device
            window = time.perf_counter()  # when the first of the pending steps began
            while self.step < t.steps:
                pending.append(self.train_step())
                self.log.stepped(pending[-1])
                due = [part for part in self.periodic if part.due(self.step)]
                stopping = self.stop is not None and self.stop.requested()  # SIGTERM
                if not (due or stopping or self.log.due(self.step)
                        or t.nan_policy == "rollback"):
                    continue
                done, pending = pending, []
                time_completed_steps(done, window, self.device)
                accounted = self._account(done)
                if accounted:  # else rolled back: a step to take again
                    for part in due:
                        part.run(self.step)
                    if stopping:
                        self._stop_on_signal()
                window = time.perf_counter()
            self._wait_for_checkpoints()
            return self.finish(started)
        finally:
            self.log.close()
            self.log = None

    def _open_run_dir(self) -> None:
        """The run directory, with this run's config.toml, before any rank writes to it."""
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.cfg.save(self.run_dir / CONFIG_FILE)
            save_run_tokenizer(self.run_dir, self.tokenizer, self.data_dir)
            if self.step == 0:  # a fresh run in a reused directory: drop the old samples
                (self.run_dir / SAMPLES_FILE).unlink(missing_ok=True)
        check_shared_directory(self.run_dir, self.grid)  # before any rank writes a shard

    def _announce(self) -> None:
        """The lines before the first step: what trains where, what makes the first step
        long, and where a resumed run goes on from."""
        assert self.log is not None
        if self.is_main:
            for line in self._describe():
                self.log.message(line)
        if self.compiler.pending:  # both make the first step long
            self.log.message("train.compile: the transformer blocks compile at their first use")
        tuner = self.pmodel.engine.tuner if self.pmodel.engine is not None else None
        if tuner is not None:
            self.log.message("parallel.gemm_tuning: GEMM shapes not yet in "
                             f"{tuner.cache_path} are timed at their first use")
        if self.resumed_from is not None:
            self._record_resume()

    def _account(self, steps: list[StepStats]) -> bool:
        """Read the numbers of `steps` (one transfer), act on train.nan_policy and log them;
        False when a bad step rolled the run back (the later steps are dropped with it)."""
        assert self.log is not None
        read_steps(steps)
        for done in steps:
            if done.skipped and self.cfg.train.nan_policy == "stop":
                raise stop_error(done.step, done.reason)
            if done.skipped and self.cfg.train.nan_policy == "rollback":
                self._rollback(done)
                return False
            self.losses.append(done.loss if not done.skipped else math.nan)
            self.train_seconds += done.seconds
            if done.skipped:
                self.skipped_steps.append(done.step)
            self.log.step(done)  # collective on a logged step (the straggler report)
        return True

    def finish(self, started: float) -> TrainResult:
        """The end of a run: the weights exported (model.safetensors, an adapter's files), a
        final sample, summary.json (with train.memory_report's figures). Collective."""
        assert self.log is not None
        t = self.cfg.train
        self.run.host.release()  # the steps' freed blocks, before the writer's
        if self.cfg.adapter.kind == "none":
            # Collective: the weights stream to the main rank one tensor at a time.
            save_weights_streamed(self.pmodel, self.run_dir / WEIGHTS_FILE,
                                  self.cfg.model.tie_embeddings)
        elif not self.grid.simulated:  # (an adapter run's files are not simulated)
            # The merged model, streamed as above, and the adapter alone in peft's files.
            write_adapter_run(self.pmodel, self.cfg, self.run_dir, self.run_dir / WEIGHTS_FILE)
        final_sample = None
        if t.sample_tokens > 0 and self._can_sample():
            final_sample = self.sample_text()  # collective on a grid
            if self.is_main:
                self._record_sample(final_sample)
            else:
                final_sample = None
        result = self._result(time.perf_counter() - started)
        memory = self._memory_report()  # collective
        if self.is_main:
            summary = self._summary(result, final_sample)
            if memory is not None:
                summary["memory_report"] = memory
            write_summary(self.run_dir, summary)
            self.log.message(f"done: {result.steps} steps, loss {result.final_loss:.4f}"
                             + (f", val_loss {result.val_loss:.4f}"
                                if result.val_loss is not None else "")
                             + f", {result.tokens_per_s:,.0f} tok/s -> {self.run_dir}")
        return result

    def _memory_report(self) -> dict[str, Any] | None:
        """train.memory_report: every rank's measured peaks beside the planner's prediction
        (collective on a grid), and every rank's whole peak (peak_mem_bytes: on the host its
        resident memory, the imports included) beside the planner's total for a rank (on the
        host above `import fourfold`)."""
        if self.memory_meter is None:
            return None
        self.memory_meter.close()
        measured, peaks = gather_reports(self.memory_meter, self.pmodel.comm,
                                         peak_memory_bytes(self.device))
        planned = predicted_memory(self.cfg, self.grid.shape, self.device.type == "cpu",
                                   resumed=self.resumed_from is not None)
        return {"measured_per_rank": measured,
                "predicted_per_rank": predicted_report(planned, self.grid.size("z")),
                "peak_bytes_per_rank": peaks, "predicted_total_bytes": planned.total}

    def _validate(self, step: int) -> None:
        assert self.log is not None
        val = self.evaluate()
        self.val_losses.append((step, val))
        self.log.record({"step": step, "val_loss": val})
        self.log.message(f"step {step}/{self.cfg.train.steps} | val_loss {val:.4f}")

    def _sample(self, step: int) -> None:
        if not self._can_sample():
            return
        text = self.sample_text()  # collective on a grid
        if self.is_main:
            self._record_sample(text)

    def _record_sample(self, text: str) -> None:
        assert self.log is not None
        self.log.message(f"--- sample at step {self.step} ---\n{text}\n---")
        with (self.run_dir / SAMPLES_FILE).open("a") as f:
            f.write(f"--- step {self.step} ---\n{text}\n")

    # ---- checkpoints and recovery -------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Checkpoint the state after the current step (collective on a grid; written in the
        background with checkpoint.async). Raises TrainingError for a failed write."""
        try:
            self.checkpoints.save(self.step)
        except CheckpointError as e:
            raise TrainingError(str(e), self.step) from None

    def _stop_on_signal(self) -> None:
        """After a SIGTERM: this step's checkpoint complete (written here unless it was due
        anyway), stop with Stopped (one line naming it)."""
        self._wait_for_checkpoints()
        written = self.checkpoints.wait()
        if written is None or step_of(written) != self.step:
            self.save_checkpoint()
            self._wait_for_checkpoints()
            written = self.checkpoints.wait()
        raise Stopped(f"stopped by SIGTERM after step {self.step}, checkpoint {written}; "
                      f"`fourfold train {self.run_dir}` resumes it")

    def _wait_for_checkpoints(self) -> None:
        try:
            self.checkpoints.wait()
        except CheckpointError as e:
            raise TrainingError(str(e), self.step) from None

    def state_dict(self) -> dict[str, Any]:
        """The loop's own counters (a checkpoint part; see CheckpointManager)."""
        return {"step": self.step, "losses": list(self.losses),
                "val_losses": [list(v) for v in self.val_losses],
                "skipped_steps": list(self.skipped_steps), "train_seconds": self.train_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.losses = [float(x) for x in state["losses"]]
        self.val_losses = [(int(s), float(v)) for s, v in state["val_losses"]]
        self.skipped_steps = [int(s) for s in state["skipped_steps"]]
        self.train_seconds = float(state["train_seconds"])

    def _restore(self, path: Path) -> None:
        """Load a checkpoint (from any grid) into this trainer and its parts. Collective on a
        grid."""
        try:
            self.checkpoints.load(path)
        except CheckpointError as e:
            raise TrainingError(str(e), self.step) from None

    def _record_resume(self) -> None:
        assert self.resumed_from is not None and self.log is not None
        record = resume_record(self.step, self.resumed_from, restart_count())
        self.log.message(f"{record['event']}: continuing from {self.resumed_from} "
                         f"(step {self.step})")
        if self.schedule.changed:
            self.log.message("the learning-rate schedule differs from the checkpoint's ("
                             f"{', '.join(self.schedule.changed)}); following the new one")
        self.log.record(record)

    def _rollback(self, stats: StepStats) -> None:
        """Go back to the last checkpoint after a bad step; the data loader keeps its place,
        so the batches that led here are not replayed."""
        self._wait_for_checkpoints()
        path = self.checkpoints.latest_valid()
        if path is None:
            raise TrainingError(f"step {stats.step}: {stats.reason}; no checkpoint to roll back "
                                "to (set checkpoint.every)", stats.step)
        last, count = self._rollbacks
        count = count + 1 if path == last else 1
        if count > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
            raise TrainingError(f"step {stats.step}: {stats.reason}; rolled back to {path} "
                                f"{count - 1} times already; stopped", stats.step)
        self._rollbacks = (path, count)
        loader_state, seconds = self.loader.state_dict(), self.train_seconds + stats.seconds
        self._restore(path)
        self.loader.load_state_dict(loader_state)
        self.train_seconds = seconds
        assert self.log is not None
        self.log.message(f"step {stats.step}: {stats.reason}: rolled back to step {self.step} "
                         f"({path})")
        self.log.record({"event": "rollback", "step": stats.step, "to_step": self.step,
                         "reason": stats.reason, "checkpoint": str(path)})

    def _describe(self) -> list[str]:
        return describe_run(self.cfg, str(self.grid.shape), self.device.type,
                            self.tokens_per_step, self.data_dir, count_parameters(self.cfg),
                            count_parameters(self.cfg, trainable_only=True))

    def _result(self, elapsed: float) -> TrainResult:
        finite = [x for x in self.losses if math.isfinite(x)]
        return TrainResult(
            final_loss=finite[-1] if finite else math.nan,
            val_loss=self.val_losses[-1][1] if self.val_losses else None,
            losses=list(self.losses), val_losses=list(self.val_losses), run_dir=self.run_dir,
            tokens_per_s=self.tokens_per_step * len(self.losses) / max(self.train_seconds, 1e-9),
            steps=self.step, time_s=elapsed, skipped_steps=list(self.skipped_steps))

    def _summary(self, result: TrainResult, sample: str | None) -> dict[str, Any]:
        return {
            "final_loss": result.final_loss, "val_loss": result.val_loss,
            "val_losses": [list(v) for v in result.val_losses],
            "tokens_per_s": result.tokens_per_s,
            "mfu": self.log.mfu(result.tokens_per_s) if self.log is not None else None,
            "steps": result.steps, "time_s": result.time_s, "train_time_s": self.train_seconds,
            "tokens": self.tokens_per_step * len(self.losses),
            "skipped_steps": result.skipped_steps, "grid": str(self.grid.shape),
            "world_size": self.world_size, "device": str(self.device),
            "peak_mem_bytes": peak_memory_bytes(self.device), "sample": sample,
            "tokenizer_fingerprint": self.cfg.data.tokenizer_fingerprint,
        }


def count_parameters(cfg: Config, trainable_only: bool = False) -> int:
    """Parameters of the whole (unsplit) model in cfg, or only those that train (an adapter
    run's adapter); no weights are allocated."""
    model = build_model(cfg.model, device="meta")
    if not trainable_only:
        return model.num_params()
    trainable = set(apply_adapter(model, cfg.adapter, cfg.train.seed))
    return sum(p.numel() for name, p in model.named_parameters() if name in trainable)


def train(cfg: Config, run_dir: Path, *, progress: bool | None = None,
          signals: StopSignals | None = None) -> TrainResult:
    """Train the model described by cfg, writing config.toml, metrics.jsonl,
    model.safetensors and summary.json into run_dir. On a grid every rank calls this.

    progress: True for a tqdm bar, False for plain log lines, None to decide by whether stderr
    is a terminal. Raises ConfigError / GridError / DataError for user mistakes and
    TrainingError when training diverges. signals: this process's SIGTERM handler (see
    fourfold.signals); a SIGTERM then stops the run after a checkpoint, with Stopped.
    """
    trainer = Trainer(cfg, run_dir, progress=progress)
    if signals is not None:
        trainer.stop = StopAgreement(signals, trainer.grid)  # collective on a grid
    return trainer.fit()


__all__ = ["Run", "StepStats", "TrainResult", "Trainer", "TrainingError", "build_run",
           "count_parameters", "train"]
