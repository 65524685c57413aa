"""build_run: the parts of a run from a Config, decided into a copy that the run records, never
into the caller's Config."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fourfold.config import load_config
from fourfold.train import Trainer
from fourfold.train.build import build_run

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py

OVERRIDES = ["model.preset=debug", "train.batch_size=8", "train.seq_len=32", "train.steps=1",
             "train.warmup_steps=0", "train.eval_every=0", "train.eval_batches=0",
             "train.sample_tokens=0", "train.log_every=1", "train.device=cpu"]


@pytest.mark.slow
def test_build_run_resolves_a_copy_and_the_run_records_it(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(hf_dir, safe_serialization=True)
    cfg = load_config(None, [*OVERRIDES, f"model.init_from={hf_dir}", "parallel.auto=true"])
    before = copy.deepcopy(cfg)

    run = build_run(cfg, tmp_path / "run")
    assert cfg == before, "build_run changed the caller's config"
    # the decisions are in the copy: the HF config.json's model, the planner's grid
    assert run.cfg is not cfg
    assert (run.cfg.model.dim, run.cfg.model.vocab_size, run.cfg.model.init_from) == \
        (64, 320, str(hf_dir))
    assert cfg.model.dim != 64
    assert (run.cfg.parallel.x, run.cfg.parallel.y, run.cfg.parallel.z,
            run.cfg.parallel.data) == (1, 1, 1, 1)
    assert cfg.parallel.data == "auto"
    assert run.pmodel.module.cfg == run.cfg.model

    Trainer.from_run(run, progress=False).fit()
    saved = load_config(tmp_path / "run" / "config.toml")
    assert saved.model == run.cfg.model and saved.parallel == run.cfg.parallel
    assert cfg == before


@pytest.mark.slow
def test_trainer_leaves_the_callers_config_alone(tmp_path: Path) -> None:
    cfg = load_config(None, [*OVERRIDES, "parallel.auto=true"])
    before = copy.deepcopy(cfg)
    trainer = Trainer(cfg, tmp_path, progress=False)
    trainer.fit()
    assert cfg == before
    assert trainer.cfg.parallel.data == 1 and cfg.parallel.data == "auto"


def test_the_fits_check_counts_the_checkpoint_library_where_the_run_will_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run directory holding a checkpoint (and checkpoint.resume on) makes build_run's
    fits-check predict a resumed run, whose loading imports the checkpoint library: here the
    difference between fitting and not. A damaged checkpoint (no manifest, a truncated file)
    the run will skip, so it does not count."""
    import json

    import fourfold.train.build as build
    from fourfold.parallel import GridShape
    from fourfold.plan.errors import PlanError
    from fourfold.plan.memory import predicted_memory
    from fourfold.train.checkpoint import MANIFEST_FILE, checkpoint_root

    cfg = load_config(None, [*OVERRIDES, "train.optimizer=mezo", "checkpoint.every=0"])
    fresh, resumed = (predicted_memory(cfg, GridShape(1, 1, 1, 1), True, r).total
                      for r in (False, True))
    assert resumed > fresh
    monkeypatch.setattr(build, "rank_memory_capacity", lambda device, ranks: fresh)
    build_run(cfg, tmp_path)  # fits: nothing to resume
    step = checkpoint_root(tmp_path) / "step_00000001"
    step.mkdir(parents=True)
    build_run(cfg, tmp_path)  # no manifest: damaged, skipped
    (step / ".metadata").write_bytes(b"12345")
    (step / MANIFEST_FILE).write_text(json.dumps(
        {"files": {".metadata": {"bytes": 9, "sha256": "0" * 64}}}))
    build_run(cfg, tmp_path)  # truncated: skipped
    (step / ".metadata").write_bytes(b"123456789")  # sizes match: counted, unhashed
    with pytest.raises(PlanError, match="under train.optimizer = 'mezo': a rank needs"):
        build_run(cfg, tmp_path)
    build_run(load_config(None, [*OVERRIDES, "train.optimizer=mezo", "checkpoint.every=0",
                                 "checkpoint.resume=false"]), tmp_path)


def test_build_run_refuses_a_seq_len_beyond_init_froms_context(tmp_path: Path) -> None:
    from fourfold.config import ConfigError

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, '
        '"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}')
    cfg = load_config(None, [*OVERRIDES, f"model.init_from={hf_dir}"])
    with pytest.raises(ConfigError, match="train.seq_len = 32 is longer than the "
                                          "max_position_embeddings = 16 of model.init_from"):
        build_run(cfg, tmp_path / "run")
