"""The training loop on one process: an end-to-end run of the debug preset on the built-in
corpus, determinism, gradient accumulation, NaN handling, metrics and the run directory."""

from __future__ import annotations

import io
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from fourfold.config import Config, ConfigError, load_config
from fourfold.train import RunDirError, Trainer, TrainingError, load_trained, train
from fourfold.train.metrics import read_metrics
from fourfold.train.progress import Progress

from test_goldfish import goldfish_kept_band

REQUIRED_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes",
                 "comm_bytes_x", "comm_bytes_y", "comm_bytes_z", "comm_bytes_data",
                 "param_bytes", "grad_bytes", "optimizer_bytes"}


pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py


def small_config(*overrides: str) -> Config:
    """The debug preset with short sequences, no samples and no validation unless asked."""
    return load_config(None, ["model.preset=debug", "train.batch_size=8", "train.seq_len=64",
                              "train.steps=6", "train.warmup_steps=2", "train.eval_every=0",
                              "train.eval_batches=0", "train.sample_tokens=0",
                              "train.log_every=1", *overrides])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, fourfold_cache: Path):
    cfg = small_config("train.steps=30", "train.warmup_steps=5", "train.eval_every=10",
                       "train.eval_batches=2", "train.log_every=10", "train.sample_tokens=16",
                       "train.sample_every=20")
    run_dir = tmp_path_factory.mktemp("run")
    trainer = Trainer(cfg, run_dir, progress=False)
    result = trainer.fit()
    return trainer, result, run_dir


def test_validation_loss_falls(finished_run) -> None:
    _, result, _ = finished_run
    steps = [s for s, _ in result.val_losses]
    assert steps == [0, 10, 20, 30]
    first, last = result.val_losses[0][1], result.val_losses[-1][1]
    assert first == pytest.approx(math.log(512), rel=0.05)  # untrained: uniform over the vocab
    assert last < 0.6 * first
    assert result.val_loss == last
    assert len(result.losses) == 30 and result.steps == 30
    assert result.final_loss == result.losses[-1]
    assert result.tokens_per_s > 0


def test_run_directory_files(finished_run) -> None:
    trainer, result, run_dir = finished_run
    saved = load_config(run_dir / "config.toml")
    assert saved == trainer.cfg
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 30
    assert summary["final_loss"] == pytest.approx(result.final_loss)
    assert summary["val_loss"] == pytest.approx(result.val_loss)
    assert summary["tokens_per_s"] > 0 and summary["time_s"] > 0
    samples = (run_dir / "samples.txt").read_text()
    assert "--- step 20 ---" in samples and "--- step 30 ---" in samples


def test_metrics_jsonl(finished_run) -> None:
    _, result, run_dir = finished_run
    records = read_metrics(run_dir / "metrics.jsonl")
    train_records = [r for r in records if "loss" in r]
    val_records = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train_records] == [10, 20, 30]
    for r in train_records:
        assert REQUIRED_KEYS <= set(r)
        assert r["loss"] == pytest.approx(result.losses[r["step"] - 1])
        assert r["mfu"] > 0  # not bounded above: a probe on a busy CPU can measure a low peak
        assert r["peak_mem_bytes"] > 0 and r["param_bytes"] > 0
        assert r["optimizer_bytes"] == 2 * r["param_bytes"]  # AdamW: two moments in float32
        assert r["comm_bytes_data"] == 0  # one process moves nothing
    assert [(r["step"], r["val_loss"]) for r in val_records] == [
        (s, pytest.approx(v)) for s, v in result.val_losses]


def test_load_trained_gives_the_same_logits(finished_run) -> None:
    trainer, _, run_dir = finished_run
    model, cfg = load_trained(run_dir)
    assert cfg == trainer.cfg
    tokens = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(0))
    trained = trainer.pmodel.module
    trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), trained(tokens), rtol=0, atol=0)


def test_load_trained_takes_the_newest_checkpoint_of_an_unfinished_run(tmp_path: Path) -> None:
    Trainer(small_config("train.steps=4", "checkpoint.every=2"), tmp_path, progress=False).fit()
    finished, _ = load_trained(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # as if the run died after its last checkpoint
    unfinished, _ = load_trained(tmp_path)
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(unfinished(tokens), finished(tokens), rtol=0, atol=0)


def test_load_trained_names_a_missing_or_incomplete_run_dir(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="nowhere"):
        load_trained(tmp_path / "nowhere")
    small_config().save(tmp_path / "config.toml")
    with pytest.raises(RunDirError, match="model.safetensors") as info:
        load_trained(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_same_seed_same_losses_and_a_new_seed_differs(tmp_path: Path) -> None:
    first = train(small_config(), tmp_path / "a", progress=False).losses
    again = train(small_config(), tmp_path / "b", progress=False).losses
    other = train(small_config("train.seed=7"), tmp_path / "c", progress=False).losses
    assert first == again
    assert first != other


def test_grad_accum_matches_one_big_batch(tmp_path: Path) -> None:
    whole = Trainer(small_config("train.steps=4", "train.grad_accum=1"), tmp_path / "a",
                    progress=False)
    accumulated = Trainer(small_config("train.steps=4", "train.grad_accum=2"), tmp_path / "b",
                          progress=False)
    torch.testing.assert_close(torch.tensor(accumulated.fit().losses),
                               torch.tensor(whole.fit().losses), rtol=1e-5, atol=0)
    # The gradient norm (logged every step) checks the gradients' scale, which Adam would hide.
    norms = [[r["grad_norm"] for r in read_metrics(tmp_path / run / "metrics.jsonl")]
             for run in ("a", "b")]
    assert len(norms[0]) == 4
    torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]), rtol=1e-5, atol=0)
    # Adam divides by sqrt(v): round-off in near-zero gradients moves a few weights by ~lr/1000.
    for (name, p), (_, q) in zip(whole.pmodel.named_parameters(),
                                 accumulated.pmodel.named_parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=2e-5, msg=name)


def _poison_step(trainer: Trainer, bad_step: int) -> None:
    """Make the forward pass of optimizer step `bad_step` produce NaN logits."""
    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output * math.nan if trainer.step + 1 == bad_step else output

    trainer.pmodel.module.norm.register_forward_hook(hook)


def test_nan_loss_stops_naming_the_step(tmp_path: Path) -> None:
    trainer = Trainer(small_config(), tmp_path, progress=False)
    _poison_step(trainer, 3)
    with pytest.raises(TrainingError, match=r"^step 3: loss is nan") as info:
        trainer.fit()
    assert info.value.step == 3 and "\n" not in str(info.value)
    assert not (tmp_path / "model.safetensors").exists()


def test_nan_loss_skip_policy_skips_the_update(tmp_path: Path) -> None:
    trainer = Trainer(small_config("train.nan_policy=skip", "train.steps=4"), tmp_path,
                      progress=False)
    _poison_step(trainer, 3)
    before: dict[str, torch.Tensor] = {}

    def remember(module: torch.nn.Module, inputs: tuple) -> None:
        if trainer.step == 2 and not before:
            before.update({n: p.detach().clone() for n, p in trainer.pmodel.named_parameters()})

    trainer.pmodel.module.register_forward_pre_hook(remember)
    original_step = trainer.train_step
    after: dict[str, torch.Tensor] = {}

    def step_and_snapshot():
        stats = original_step()
        if stats.step == 3:
            after.update({n: p.detach().clone() for n, p in trainer.pmodel.named_parameters()})
        return stats

    trainer.train_step = step_and_snapshot  # type: ignore[method-assign]
    result = trainer.fit()
    assert result.skipped_steps == [3] and result.steps == 4
    assert math.isnan(result.losses[2]) and all(math.isfinite(x) for x in result.losses[3:])
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r.get("skipped")] == [3]


def test_a_bad_galore_refresh_step_is_stopped_or_skipped_whole(tmp_path: Path) -> None:
    """GaLore refreshes its basis inside backward, before the guard sees the step: a NaN step
    that is a refresh step stops with the NaN's own error (not eigh's), and a refresh step the
    guard rejects under "skip" (a spike) leaves the basis, the moments and the weights as they
    were."""
    # a small side under 32, where eigh of a NaN Gram raises (larger ones return NaN vectors)
    galore = ("train.optimizer=galore", "model.dim=24", "model.n_heads=2", "model.n_kv_heads=1",
              "model.ffn_dim=64")
    stopped = Trainer(small_config(*galore, "train.method.gap=2"), tmp_path / "stop",
                      progress=False)  # steps 1, 3, 5 refresh
    _poison_step(stopped, 3)
    with pytest.raises(TrainingError, match=r"^step 3: loss is nan"):
        stopped.fit()

    # every step after the first five is a spike; step 6 (5 steps done) refreshes
    trainer = Trainer(small_config(*galore, "train.method.gap=5", "train.steps=7",
                                   "train.spike_threshold=0.5", "train.nan_policy=skip"),
                      tmp_path / "skip", progress=False)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    refreshed: list[int] = []
    original_step, original_projection = trainer.train_step, trainer.method._projection

    def step_and_snapshot():
        stats = original_step()
        tensors, _ = trainer.method.state_dict()
        snapshots[stats.step] = {**{k: t.clone() for k, t in tensors.items()},
                                 **{n: p.detach().clone()
                                    for n, p in trainer.pmodel.named_parameters()}}
        return stats

    def projection(*args):
        refreshed.append(trainer.step + 1)
        return original_projection(*args)

    trainer.train_step = step_and_snapshot  # type: ignore[method-assign]
    trainer.method._projection = projection  # type: ignore[method-assign]
    result = trainer.fit()
    assert result.skipped_steps == [6, 7]
    assert sorted(set(refreshed)) == [1, 6, 7]
    assert any(k.endswith("/proj") for k in snapshots[5])
    for key, value in snapshots[5].items():
        assert torch.equal(value, snapshots[6][key]), key


def test_vocab_larger_than_the_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.vocab_size = 200 .*257") as info:
        Trainer(small_config("model.vocab_size=200"), tmp_path)
    assert "\n" not in str(info.value)


def test_batch_that_does_not_split_into_micro_steps(tmp_path: Path) -> None:
    cfg = small_config("train.grad_accum=2")
    cfg.train.batch_size = 6  # validate() accepts it (2 divides 6) ...
    cfg.train.grad_accum = 4  # ... but not this
    with pytest.raises(ConfigError, match="grad_accum"):
        Trainer(cfg, tmp_path)


@pytest.mark.slow
def test_goldfish_bfloat16_and_checkpointing_run(tmp_path: Path) -> None:
    cfg = small_config("train.loss=goldfish", "train.goldfish_k=4", "train.goldfish_h=13",
                       "train.dtype=bfloat16",
                       "train.activation_checkpointing=true", "train.grad_accum=2",
                       "train.steps=3")
    trainer = Trainer(cfg, tmp_path, progress=False)
    assert trainer.pmodel.module.activation_checkpointing
    result = trainer.fit()
    assert all(math.isfinite(x) for x in result.losses)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    fractions = [r["loss_token_fraction"] for r in steps]
    assert len(fractions) == 3
    # with checkpointing the recomputed forward counts as hardware FLOPs: HFU above MFU
    assert all(r["hfu"] > r["mfu"] > 0 for r in steps if r["mfu"] is not None)
    assert any(r["mfu"] is not None for r in steps)
    # about 1 in k of the targets with a whole context dropped: 8 rows of 64 over 3 steps of
    # the built-in corpus, whose windows hardly overlap (one verdict per target)
    expected, tolerance = goldfish_kept_band(4, 13, 64, verdicts=3 * 8 * (64 - 13 + 1))
    assert abs(sum(fractions) / 3 - expected) <= tolerance, (fractions, expected, tolerance)


def test_compile_failure_falls_back_with_a_warning(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_compile(self: torch.nn.Module) -> None:
        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError("no compiler here")
        self._compiled_call_impl = fail

    monkeypatch.setattr(torch.nn.Module, "compile", broken_compile)
    reference = train(small_config("train.steps=3"), tmp_path / "a", progress=False).losses
    with pytest.warns(UserWarning, match="no compiler here"):
        compiled = train(small_config("train.steps=3", "train.compile=true"), tmp_path / "b",
                         progress=False).losses
    assert compiled == reference


@pytest.mark.compile
def test_compile_runs_the_parallel_linears_and_matches_eager(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """train.compile with GEMM tuning on: the blocks hold Linear3D layers (collectives, deferred
    GEMMs, oneDNN calls that Inductor cannot lower), which run eagerly between compiled
    regions. It used to fail at the first step and fall back to eager with a warning."""
    cfg = ("train.steps=3", "parallel.gemm_tuning=true")
    reference = train(small_config(*cfg), tmp_path / "a", progress=False).losses
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(small_config(*cfg, "train.compile=true"), tmp_path / "b",
                          progress=False)
        compiled = trainer.fit().losses
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    assert trainer.compiler.active, "the blocks were uncompiled"
    err = capsys.readouterr().err  # a long first step is announced
    assert "train.compile: the transformer blocks compile" in err
    assert "parallel.gemm_tuning: GEMM shapes not yet in" in err
    assert compiled == pytest.approx(reference, rel=1e-4)


def test_plain_progress_lines_every_log_every_steps() -> None:
    out = io.StringIO()
    progress = Progress(5, 0, 2, enabled=True, bar=False, stream=out)
    for step in range(1, 6):
        progress.step(step, 1.0 / step, 1e-3, 0.5, 1000.0, 0.25)
    lines = out.getvalue().splitlines()
    assert [line.split("|")[0].strip() for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert "mfu 25.0%" in lines[0]
    silent = io.StringIO()
    Progress(5, 0, 1, enabled=False, bar=False, stream=silent).step(1, 1.0, 1e-3, 0.5, 1.0, None)
    assert silent.getvalue() == ""


def test_progress_bar_on_a_terminal_shows_loss_and_throughput() -> None:
    out = io.StringIO()
    progress = Progress(3, 0, 100, enabled=True, bar=True, stream=out)
    for step in range(1, 4):
        progress.step(step, 2.5, 1e-3, 0.5, 1234.0, None)
    progress.close()
    text = out.getvalue()
    assert "3/3" in text and "loss=2.5000" in text and "tok_s=1,234" in text
    assert "step 3/3 |" not in text  # no plain log lines next to the bar


def test_init_from_a_hugging_face_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from fourfold.models.hf import state_dict_to_hf
    from fourfold.models.llama import build_model

    cfg = small_config()
    source = build_model(cfg.model, seed=99)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file({k: v.contiguous() for k, v in state_dict_to_hf(source.state_dict(),
                                                              cfg.model).items()},
              str(hf_dir / "model.safetensors"))
    cfg.model.init_from = str(hf_dir)
    trainer = Trainer(cfg, tmp_path / "run")
    for name, value in source.state_dict().items():
        assert torch.equal(trainer.pmodel.module.state_dict()[name], value), name
    cfg.model.init_from = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(ConfigError, match="no-such-checkpoint"):
        Trainer(cfg, tmp_path / "run")
