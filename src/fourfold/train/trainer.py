"""The training loop: one code path from one CPU process to a 4D grid of GPUs.

    cfg -> init_distributed -> Grid -> build_model -> parallelize -> Trainer.fit()

Every step fetches the whole step's batch for this rank, splits it into train.grad_accum
micro-batches, and normalizes the loss by the number of counted tokens in the whole job's step
(see parallel_api: exact against a single process for every grid shape and accumulation).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from fourfold.config import Config, ConfigError, validate
from fourfold.data import BatchLoader, Tokenizer, load_tokenizer, resolve_data_path
from fourfold.launch import cores_available
from fourfold.models.adapter import apply_adapter, finish_adapter
from fourfold.models.llama import Llama, build_model, flops_per_token
from fourfold.parallel import Grid, GridShape, ParallelModel, init_distributed, parallelize
from fourfold.train.checkpoint import CheckpointError, CheckpointManager, hf_model_config
from fourfold.train.host_memory import keep_freed_host_memory
from fourfold.train.metrics import (MetricsLog, cpu_peak_flops, device_peak_flops,
                                    peak_memory_bytes)
from fourfold.train.optim import build_optimizer, lr_at, set_lr
from fourfold.train.progress import Progress
from fourfold.train.resilience import (LossGuard, gather_step_times, restart_count,
                                       resume_record, straggler_report)
from fourfold.train.runs import (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, WEIGHTS_FILE,
                                 save_weights, write_summary)
from fourfold.train.sampling import generate

SAMPLE_PROMPT_TOKENS = 16
SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 40
# Above this many parameters rank 0 does not rebuild the whole model on its own to sample.
MAX_GATHERED_SAMPLE_PARAMS = 2_000_000_000
# train.nan_policy = "rollback" gives up after this many rollbacks to the same checkpoint.
MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN loss under nan_policy = "stop"); one line for the user."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    skipped: bool
    seconds: float
    token_fraction: float  # counted tokens / all tokens (below 1 with the goldfish loss)
    reason: str = ""  # why the step was bad (NaN/inf, spike), when it was


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
    """Builds everything a run needs from a Config and trains it.

    Usable alone from Python: `Trainer(cfg, run_dir).fit()`, or with a model built elsewhere
    (`model=`, a fourfold Llama whose config matches cfg.model). On a grid, every rank constructs
    a Trainer and calls the same methods in the same order (several of them are collective).
    """

    def __init__(self, cfg: Config, run_dir: str | Path, *, model: Llama | None = None,
                 progress: bool | None = None) -> None:
        validate(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        t, p = cfg.train, cfg.parallel

        self.rank, self.world_size, dist_device = init_distributed(p.backend, p.timeout_s,
                                                                   device=t.device)
        self.device = _choose_device(t.device, dist_device, self.world_size)
        if self.device.type == "cpu":
            keep_freed_host_memory()  # no fresh zero-filled pages every step
        if p.auto:
            shape = _planned_grid(cfg, self.world_size, self.rank)
            p.x, p.y, p.z, p.data = shape.x, shape.y, shape.z, shape.data
        shape = GridShape.resolve(p.x, p.y, p.z, p.data, self.world_size)
        self.grid: Grid = Grid.build(shape, self.device, timeout_s=p.timeout_s)
        self.is_main = self.rank == 0
        shard_index, shard_count = self.grid.batch_shard
        if t.batch_size % (t.grad_accum * shard_count):
            raise ConfigError(
                f"train.batch_size = {t.batch_size} does not split into train.grad_accum = "
                f"{t.grad_accum} micro-steps over data*z = {shard_count} batch shards; use a "
                f"multiple of {t.grad_accum * shard_count}")
        torch.manual_seed(t.seed)

        if model is None and cfg.model.init_from and \
                (Path(cfg.model.init_from) / "config.json").is_file():
            # The architecture is the checkpoint's config.json (without one, cfg.model's);
            # the path stays in the config.
            cfg.model = dataclasses.replace(hf_model_config(cfg.model.init_from),
                                            init_from=cfg.model.init_from)
        self.data_dir = resolve_data_path(cfg.data.path, cfg.data.tokenizer)
        self.tokenizer: Tokenizer = load_tokenizer(self.data_dir)
        if cfg.model.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"model.vocab_size = {cfg.model.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size} tokens ({self.data_dir}); set model.vocab_size to "
                f"at least {self.tokenizer.vocab_size}")

        init_from = cfg.model.init_from if model is None else ""
        if model is None:
            model = build_model(cfg.model, seed=t.seed)
        elif model.cfg != cfg.model:
            raise ConfigError("the model passed to Trainer does not match cfg.model; build it "
                              "with build_model(cfg.model)")
        # Set before parallelize, which converts the layers in place and keeps the flag.
        model.activation_checkpointing = t.activation_checkpointing
        model.to(self.device)
        self.pmodel: ParallelModel = parallelize(model, self.grid, p)
        if init_from:
            from fourfold.train.checkpoint import load_hf_into  # fine-tuning runs only

            load_hf_into(self.pmodel, init_from)  # each rank reads just its own shards
        # Adapter seam (issue 17): freeze the base, add LoRA factors or free the norm gains;
        # before compile and the optimizer, which then see only the adapter as trainable.
        apply_adapter(self.pmodel, cfg.adapter, t.seed)
        self._compiled: list[torch.nn.Module] = []
        self._compile_verified = not t.compile
        if t.compile:
            self._compile()
        self.optimizer = build_optimizer(self.pmodel.named_parameters(), t,
                                         tied_output=cfg.model.tie_embeddings)

        # The loader hands out whole steps; micro-batches are slices of them, so the data a
        # step sees does not depend on grad_accum.
        self.loader = BatchLoader(self.data_dir, "train", t.batch_size, t.seq_len, t.seed,
                                  shard_index=shard_index, num_shards=shard_count)
        # Validation batches are whole steps too (evaluated in micro-batch slices), so the
        # validation set depends neither on grad_accum nor on the grid.
        self.val_loader = BatchLoader(self.data_dir, "val", t.batch_size, t.seq_len, t.seed,
                                      shard_index=shard_index, num_shards=shard_count)
        self._val_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None

        self.step = 0
        self.tokens_per_step = t.batch_size * t.seq_len
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak_flops = device_peak_flops(self.device, t.dtype) if self.is_main else None
        self._peak_devices = self._devices()  # fixed for the run: world, threads, cores
        self._peak_refreshed = False
        self.progress_choice = progress
        self.losses: list[float] = []
        self.val_losses: list[tuple[int, float]] = []
        self.skipped_steps: list[int] = []
        self.train_seconds = 0.0

        self.guard = LossGuard(t.spike_threshold)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint, self.grid)
        self.resumed_from: Path | None = None
        self._rollbacks: tuple[Path | None, int] = (None, 0)  # (checkpoint, rollbacks to it)
        if cfg.checkpoint.resume:
            path = self.checkpoints.latest_valid()  # collective on a grid
            if path is not None:
                self._restore(path)
                self.resumed_from = path

    # ---- building blocks ----------------------------------------------------------------

    def _autocast(self) -> torch.autocast:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.train.dtype == "bfloat16")

    def _compile(self) -> None:
        """Compile each transformer block in place (the engine's hooks stay outside the
        compiled regions); the whole module when it has no `layers`."""
        module = self.pmodel.module
        targets = list(getattr(module, "layers", [])) or [module]
        for block in targets:
            block.compile()
        self._compiled = targets

    def _uncompile(self, error: BaseException) -> None:
        warnings.warn(f"torch.compile failed ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); training without "
                      "compile", stacklevel=2)
        for block in self._compiled:
            block._compiled_call_impl = None  # what nn.Module.compile() set
        self._compiled = []

    @contextmanager
    def _eager(self) -> Iterator[None]:
        """Run the compiled blocks uncompiled for a while: token-by-token decoding with a
        growing cache would recompile them for every new length."""
        saved = [(block, block._compiled_call_impl) for block in self._compiled]
        for block, _ in saved:
            block._compiled_call_impl = None
        try:
            yield
        finally:
            for block, impl in saved:
                block._compiled_call_impl = impl

    def _loss_mask(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = self.cfg.train
        if t.loss == "goldfish":
            from fourfold.train.goldfish import goldfish_mask  # only runs that ask for it

            return goldfish_mask(inputs, targets, t.goldfish_k, t.goldfish_h).float()
        return torch.ones(targets.shape, dtype=torch.float32, device=targets.device)

    def _val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._val_cache is None:
            batches = self.val_loader.eval_batches(self.cfg.train.eval_batches)
            self._val_cache = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        return self._val_cache

    # ---- one step -----------------------------------------------------------------------

    def train_step(self) -> StepStats:
        """One optimizer step (train.grad_accum micro-steps). Collective on a grid."""
        if self._compile_verified:
            return self._train_step()
        loader_state = self.loader.state_dict()
        try:
            stats = self._train_step()
        except TrainingError:
            raise
        except Exception as e:  # compile errors surface at the first call, not at compile()
            self._uncompile(e)
            self.optimizer.zero_grad(set_to_none=True)
            self.loader.load_state_dict(loader_state)
            stats = self._train_step()
        self._compile_verified = True
        return stats

    def _train_step(self) -> StepStats:
        t = self.cfg.train
        start = time.perf_counter()
        step = self.step + 1
        lr = lr_at(step, t)
        set_lr(self.optimizer, lr)
        self.pmodel.ledger.reset()

        inputs, targets = self.loader.next_batch()  # (B / shards, T)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        micro = list(zip(inputs.chunk(t.grad_accum), targets.chunk(t.grad_accum)))
        masks = [self._loss_mask(x, y) for x, y in micro]
        local_count = torch.stack([m.sum() for m in masks]).sum()
        global_count = self.pmodel.reduce_over_batch(local_count).clamp(min=1.0)

        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for i, ((x, y), mask) in enumerate(zip(micro, masks)):
            self.pmodel.set_requires_gradient_sync(i == len(micro) - 1)
            with self._autocast():
                per_token = self.pmodel(x, y)  # (b, T)
            loss = (per_token.float() * mask).sum() / global_count
            loss.backward()
            self.pmodel.finish_backward()
            loss_sum += loss.detach()
        loss_value = float(self.pmodel.reduce_over_batch(loss_sum))
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = float(self.pmodel.clip_grad_norm_(max_norm))

        # loss_value and grad_norm are reduced over the grid: every rank judges alike.
        what = self.guard.check(loss_value, grad_norm)
        if what is not None:
            if t.nan_policy == "stop":
                raise TrainingError(
                    f"step {step}: {what}; stopped (train.nan_policy = {t.nan_policy!r}); try a "
                    "lower train.lr or train.nan_policy = \"skip\"", step)
            self.optimizer.zero_grad(set_to_none=True)  # skip; fit() rolls back if asked
        else:
            self.optimizer.step()
            self.guard.accept(loss_value)
        self.step = step
        return StepStats(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm,
                         skipped=what is not None, seconds=time.perf_counter() - start,
                         token_fraction=float(global_count) / self.tokens_per_step,
                         reason=what or "")

    # ---- evaluation and samples -----------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss per token over train.eval_batches fixed batches (the same
        batches every time), reduced over the batch axes. Collective on a grid."""
        module = self.pmodel.module
        was_training = module.training
        module.eval()
        try:
            loss_sum = torch.zeros((), device=self.device)
            count = torch.zeros((), device=self.device)
            micro_steps = self.cfg.train.grad_accum
            for inputs, targets in self._val_batches():
                for x, y in zip(inputs.chunk(micro_steps), targets.chunk(micro_steps)):
                    with self._autocast():
                        per_token = self.pmodel(x, y)
                    loss_sum += per_token.float().sum()
                    count += per_token.numel()
            totals = self.pmodel.reduce_over_batch(torch.stack([loss_sum, count]))
        finally:
            module.train(was_training)
        return float(totals[0] / totals[1].clamp(min=1.0))

    def _sample_prompt(self) -> list[int]:
        batches = self._val_batches() or [
            tuple(b.to(self.device) for b in self.val_loader.eval_batches(1)[0])]
        return batches[0][0][0, :SAMPLE_PROMPT_TOKENS].tolist()

    def sample_text(self, model: Llama) -> str:
        """A continuation of a validation-text prompt by `model` (a whole, local model)."""
        prompt = self._sample_prompt()
        with self._autocast(), self._eager():
            new = generate(model, prompt, self.cfg.train.sample_tokens,
                           temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K,
                           seed=self.cfg.train.seed, vocab_size=self.tokenizer.vocab_size)
        return self.tokenizer.decode(prompt) + self.tokenizer.decode(new)

    def _local_whole_model(self) -> Llama | None:
        """The model itself when one process holds all of it (no grid), else None."""
        module = self.pmodel.module
        if self.world_size == 1 and isinstance(module, Llama):
            return module
        return None

    def _model_from_state(self, state: dict[str, torch.Tensor]) -> Llama | None:
        if sum(v.numel() for v in state.values()) > MAX_GATHERED_SAMPLE_PARAMS:
            return None
        model = Llama(self.cfg.model)
        model.load_state_dict(state, strict=False)
        return model.to(self.device)

    # ---- the run ------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Train to train.steps, evaluating, logging and sampling on the way; then write
        model.safetensors and summary.json to the run directory (main rank)."""
        t = self.cfg.train
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.cfg.save(self.run_dir / CONFIG_FILE)
            if self.step == 0:  # a fresh run in a reused directory: drop the old samples
                (self.run_dir / SAMPLES_FILE).unlink(missing_ok=True)
        metrics = (MetricsLog(self.run_dir / METRICS_FILE,
                              self.run_dir / "tensorboard" if t.tensorboard else None,
                              append=self.step > 0)
                   if self.is_main else None)
        progress = Progress(t.steps, self.step, t.log_every, enabled=self.is_main,
                            bar=self.progress_choice)
        started = time.perf_counter()
        try:
            if self.is_main:
                progress.message(self._describe())
            if not self._compile_verified:  # both make the first step long
                progress.message("train.compile: the transformer blocks compile at their "
                                 "first use")
            tuner = self.pmodel.engine.tuner if self.pmodel.engine is not None else None
            if tuner is not None:
                progress.message("parallel.gemm_tuning: GEMM shapes not yet in "
                                 f"{tuner.cache_path} are timed at their first use")
            validating = t.eval_batches > 0
            if self.resumed_from is not None:
                self._record_resume(metrics, progress)
            if validating and t.eval_every > 0 and self.step == 0:
                self._validate(metrics, progress)
            interval_tokens, interval_seconds = 0, 0.0
            while self.step < t.steps:
                stats = self.train_step()
                if stats.skipped and t.nan_policy == "rollback":
                    self._rollback(stats, metrics, progress)
                    continue
                self.losses.append(stats.loss if not stats.skipped else math.nan)
                self.train_seconds += stats.seconds
                interval_tokens += self.tokens_per_step
                interval_seconds += stats.seconds
                tokens_per_s = interval_tokens / max(interval_seconds, 1e-9)
                mfu = self._mfu(tokens_per_s)
                progress.step(stats.step, stats.loss, stats.lr, stats.grad_norm, tokens_per_s, mfu)
                if stats.skipped:
                    self.skipped_steps.append(stats.step)
                    progress.message(f"step {stats.step}: {stats.reason}: update skipped "
                                     "(train.nan_policy = \"skip\")")
                last = stats.step == t.steps
                if stats.skipped or stats.step % t.log_every == 0 or last:
                    self._log_step(metrics, stats, tokens_per_s, mfu)
                    self._report_stragglers(stats, metrics, progress)  # collective
                    interval_tokens, interval_seconds = 0, 0.0
                if validating and ((t.eval_every > 0 and stats.step % t.eval_every == 0) or last):
                    self._validate(metrics, progress)
                if t.sample_every > 0 and stats.step % t.sample_every == 0 and not last:
                    self._sample_during(progress)
                if self.checkpoints.due(stats.step):
                    self.save_checkpoint()
            self._wait_for_checkpoints()

            # Collective: every rank takes part in gathering the full weights.
            state = self.pmodel.full_state_dict()
            if self.is_main:
                state = finish_adapter(state, self.cfg, self.run_dir)  # adapter seam (issue 17)
                save_weights(state, self.run_dir / WEIGHTS_FILE, self.cfg.model.tie_embeddings)
            final_sample = None
            if self.is_main and t.sample_tokens > 0:
                model = self._local_whole_model() or self._model_from_state(state)
                if model is None:
                    progress.message("no final sample: the model is too large to rebuild on "
                                     "one rank")
                else:
                    final_sample = self.sample_text(model)
                    self._record_sample(progress, final_sample)
            del state
            result = self._result(time.perf_counter() - started)
            if self.is_main:
                write_summary(self.run_dir, self._summary(result, final_sample))
                progress.message(f"done: {result.steps} steps, loss {result.final_loss:.4f}"
                                 + (f", val_loss {result.val_loss:.4f}"
                                    if result.val_loss is not None else "")
                                 + f", {result.tokens_per_s:,.0f} tok/s -> {self.run_dir}")
            return result
        finally:
            progress.close()
            if metrics is not None:
                metrics.close()

    def _validate(self, metrics: MetricsLog | None, progress: Progress) -> None:
        val = self.evaluate()
        self.val_losses.append((self.step, val))
        if metrics is not None:
            metrics.write({"step": self.step, "val_loss": val})
        progress.message(f"step {self.step}/{self.cfg.train.steps} | val_loss {val:.4f}")

    def _sample_during(self, progress: Progress) -> None:
        model = self._local_whole_model()
        if model is None:  # on a grid only the final sample is made (from gathered weights)
            if self.step == self.cfg.train.sample_every:
                progress.message("samples during training are skipped on a grid; the final "
                                 "sample comes at the end")
            return
        if self.is_main:
            self._record_sample(progress, self.sample_text(model))

    def _record_sample(self, progress: Progress, text: str) -> None:
        progress.message(f"--- sample at step {self.step} ---\n{text}\n---")
        with (self.run_dir / SAMPLES_FILE).open("a") as f:
            f.write(f"--- step {self.step} ---\n{text}\n")

    def _devices(self) -> float:
        """How many times the probed peak the job can reach: one device per rank on GPUs; on
        CPUs, ranks that share a machine share its cores (the probe ran on one rank's threads)."""
        if self.device.type != "cpu":
            return float(self.world_size)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        share = min(1.0, cores_available() / (local * torch.get_num_threads()))
        return self.world_size * share

    def _mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak_flops:
            return None
        mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self._peak_devices)
        if mfu > 1.0 and self.device.type == "cpu" and not self._peak_refreshed:
            # the cached probe was taken on a busy machine: measure again (keeps the max)
            self._peak_refreshed = True
            self.peak_flops = cpu_peak_flops(self.cfg.train.dtype, refresh=True)
            mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self._peak_devices)
        return mfu

    def _log_step(self, metrics: MetricsLog | None, stats: StepStats, tokens_per_s: float,
                  mfu: float | None) -> None:
        # Every rank reads its own ledger, but only the main rank writes: its numbers stand for
        # the per-rank traffic (all ranks of one grid shape move the same bytes per axis).
        comm = self.pmodel.ledger.snapshot()
        memory = self.pmodel.memory_bytes(self.optimizer)
        if metrics is None:
            return
        record: dict[str, Any] = {
            "step": stats.step, "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
            "tokens_per_s": tokens_per_s, "mfu": mfu,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "comm_bytes_x": comm.get("x", 0), "comm_bytes_y": comm.get("y", 0),
            "comm_bytes_z": comm.get("z", 0), "comm_bytes_data": comm.get("data", 0),
            "param_bytes": memory.get("params", 0), "grad_bytes": memory.get("grads", 0),
            "optimizer_bytes": memory.get("optimizer", 0), "step_seconds": stats.seconds,
        }
        if self.cfg.train.loss == "goldfish":
            record["loss_token_fraction"] = stats.token_fraction
        if stats.skipped:
            record["skipped"] = True
            record["skip_reason"] = stats.reason
        metrics.write(record)

    # ---- checkpoints and recovery -------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Checkpoint the state after the current step (collective on a grid; written in the
        background with checkpoint.async). Raises TrainingError for a failed write."""
        try:
            self.checkpoints.save(self.step, self.pmodel, self.optimizer, self._checkpoint_extra())
        except CheckpointError as e:
            raise TrainingError(str(e), self.step) from None

    def _wait_for_checkpoints(self) -> None:
        try:
            self.checkpoints.wait()
        except CheckpointError as e:
            raise TrainingError(str(e), self.step) from None

    def _checkpoint_extra(self) -> dict[str, Any]:
        """Everything besides weights and optimizer a resumed run needs to go on exactly (the
        learning rate is a function of the step; RNG states are saved by the manager)."""
        return {"step": self.step, "loader": self.loader.state_dict(),
                "guard": self.guard.state_dict(), "losses": list(self.losses),
                "val_losses": list(self.val_losses), "skipped_steps": list(self.skipped_steps),
                "train_seconds": self.train_seconds}

    def _restore(self, path: Path) -> None:
        """Load a checkpoint (from any grid) into this trainer. Collective on a grid."""
        try:
            extra = self.checkpoints.load(path, self.pmodel, self.optimizer)
        except CheckpointError as e:
            raise TrainingError(str(e), self.step) from None
        self.step = int(extra["step"])
        self.loader.load_state_dict(extra["loader"])
        self.guard.load_state_dict(extra["guard"])
        self.losses = list(extra["losses"])
        self.val_losses = [tuple(v) for v in extra["val_losses"]]  # type: ignore[misc]
        self.skipped_steps = list(extra["skipped_steps"])
        self.train_seconds = float(extra["train_seconds"])

    def _record_resume(self, metrics: MetricsLog | None, progress: Progress) -> None:
        assert self.resumed_from is not None
        record = resume_record(self.step, self.resumed_from, restart_count())
        progress.message(f"{record['event']}: continuing from {self.resumed_from} "
                         f"(step {self.step})")
        if metrics is not None:
            metrics.write(record)

    def _rollback(self, stats: StepStats, metrics: MetricsLog | None,
                  progress: Progress) -> None:
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
        progress.message(f"step {stats.step}: {stats.reason}: rolled back to step {self.step} "
                         f"({path})")
        if metrics is not None:
            metrics.write({"event": "rollback", "step": stats.step, "to_step": self.step,
                           "reason": stats.reason, "checkpoint": str(path)})

    def _report_stragglers(self, stats: StepStats, metrics: MetricsLog | None,
                           progress: Progress) -> None:
        """All-gather every rank's step time and name the ranks much slower than the rest."""
        if self.world_size == 1:
            return
        times = gather_step_times(stats.seconds, self.pmodel.comm)
        line = straggler_report(times)
        if line is None:
            return
        progress.message(f"step {stats.step}: {line}")
        if metrics is not None:
            metrics.write({"event": "straggler", "step": stats.step, "step_seconds": times,
                           "message": line})

    def _describe(self) -> str:
        n = count_parameters(self.cfg)
        return (f"fourfold: {self.cfg.model.preset} model ({n / 1e6:.1f}M parameters), grid "
                f"{self.grid.shape}, {self.device.type}, {self.cfg.train.dtype}, "
                f"{self.cfg.train.steps} steps of {self.tokens_per_step:,} tokens, "
                f"data {self.data_dir}")

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
            "tokens_per_s": result.tokens_per_s, "mfu": self._mfu(result.tokens_per_s),
            "steps": result.steps, "time_s": result.time_s, "train_time_s": self.train_seconds,
            "tokens": self.tokens_per_step * len(self.losses),
            "skipped_steps": result.skipped_steps, "grid": str(self.grid.shape),
            "world_size": self.world_size, "device": str(self.device),
            "peak_mem_bytes": peak_memory_bytes(self.device), "sample": sample,
        }


def count_parameters(cfg: Config) -> int:
    """Parameters of the whole (unsplit) model in cfg; no weights are allocated."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    return model.num_params()


def _choose_device(requested: str, dist_device: torch.device, world_size: int) -> torch.device:
    if world_size > 1:
        return dist_device  # init_distributed picked it with the backend
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device = \"cuda\" but no CUDA device is available; use "
                              "\"cpu\" or \"auto\"")
        return torch.device("cuda")
    return torch.device("cpu")


def train(cfg: Config, run_dir: Path, *, progress: bool | None = None) -> TrainResult:
    """Train the model described by cfg, writing config.toml, metrics.jsonl,
    model.safetensors and summary.json into run_dir. On a grid every rank calls this.

    progress: True for a tqdm bar, False for plain log lines, None to decide by whether stderr
    is a terminal. Raises ConfigError / GridError / DataError for user mistakes and
    TrainingError when training diverges.
    """
    return Trainer(cfg, run_dir, progress=progress).fit()


__all__ = ["StepStats", "TrainResult", "Trainer", "TrainingError", "count_parameters", "train"]


def _planned_grid(cfg: Config, world_size: int, rank: int) -> GridShape:
    """parallel.auto: rank 0 asks the planner for the fastest grid that fits and tells the
    others (each rank's own CPU probe could differ, and all ranks must build the same grid)."""
    choice: list[object] = [None]
    if rank == 0:
        from fourfold.plan import choose_grid  # the planner never imports the trainer

        t = cfg.train
        shape, why = choose_grid(cfg.model, world_size, cfg.parallel.machine, t.batch_size,
                                 t.seq_len, dtype=t.dtype,
                                 activation_checkpointing=t.activation_checkpointing,
                                 grad_accum=t.grad_accum)
        print(f"parallel.auto chose grid {shape}: {why}", file=sys.stderr, flush=True)
        choice[0] = (shape.data, shape.z, shape.y, shape.x)
    if world_size > 1:
        dist.broadcast_object_list(choice, src=0)
    data, z, y, x = choice[0]  # type: ignore[misc]
    return GridShape(data=data, z=z, y=y, x=x)
