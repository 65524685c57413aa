"""LoRA and norm tuning: every grid trains the same adapter as one process (see lora_worker.py),
the [adapter] config's bad input, and the Hugging Face side (peft files, merged checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fourfold.config import AdapterConfig, ConfigError, load_config, model_config
from fourfold.models import build_model
from fourfold.models.adapter import (apply_adapter, merged_state_dict, save_merged_hf,
                                     save_peft_adapter)
from fourfold.models.hf import config_to_hf, state_dict_to_hf
from fourfold.parallel import GridShape
from fourfold.plan.schedule import predict_comm_bytes
from test_parallel import run_worker  # the shared torchrun launcher (tests/ is on sys.path)

WORKER = Path(__file__).with_name("lora_worker.py")

ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down", "output"]
VARIANTS = [
    {"kind": "lora"},
    # SGD here: AdamW divides tiny gradients by their own size and magnifies float noise
    {"kind": "lora", "targets": ALL_TARGETS, "train_norms": True, "bias": True, "accum": 2,
     "r": 4, "alpha": 8.0, "opt": "sgd"},
    {"kind": "lora", "hf": True, "ckpt": True},
    # SGD too: the tied embedding's rare rows get tiny gradients that AdamW would magnify
    # (5.7e-4 measured with AdamW on x2 y2; 7e-7 with SGD)
    {"kind": "norm", "train_output": True, "tie": True, "opt": "sgd"},
    {"kind": "lora", "dropout": 0.2, "ckpt": True},  # replicas agree; no one-process twin
]

LORA_STEPS, LORA_BATCH, LORA_SEQ = 20, 8, 16  # as in lora_worker.py
GRIDS = {  # (data, z, y, x)
    2: [[1, 1, 1, 2], [1, 1, 2, 1], [1, 2, 1, 1], [2, 1, 1, 1]],
    4: [[1, 1, 2, 2], [2, 2, 1, 1], [1, 2, 1, 2], [2, 1, 2, 1]],
}


@pytest.mark.ranks
@pytest.mark.parametrize("nproc", [2, 4])
def test_adapters_train_the_same_on_every_grid(nproc: int, tmp_path: Path) -> None:
    for r in run_worker(nproc, GRIDS[nproc], VARIANTS, tmp_path, WORKER, timeout=900):
        label = f"grid {r['shape']} variant {r['variant']} rank {r['rank']}"
        assert r["same_trainable"] and r["n_trainable"] > 0, label
        assert r["max_frozen_change"] == 0.0, f"{label}: the frozen base moved"
        assert r["replica_spread"] == 0.0, f"{label}: replicas differ by {r['replica_spread']}"
        data, z, y, x = r["shape"]
        for axis, size in (("x", x), ("y", y), ("z", z), ("data", data)):
            assert (r["ledger"][axis] > 0) == (size > 1), f"{label}: ledger {r['ledger']}"
        # the ledger is what torch.distributed was handed (dist_count.py), and for LoRA on
        # fourfold's Llama the planner predicts it exactly: the (tokens x r) all-reduces, their
        # backward twins, the adapter's gradient reductions, and no dW traffic for the base
        assert r["handed"] == {k: r["ledger"][k] for k in r["handed"]}, \
            f"{label}: torch.distributed was handed {r['handed']}, ledger {r['ledger']}"
        variant = r["variant"]
        if variant["kind"] == "lora" and not variant.get("hf"):
            cfg = model_config("debug", bias=variant.get("bias", False),
                               tie_embeddings=variant.get("tie", False))
            accum = variant.get("accum", 1)
            tokens = LORA_BATCH // accum // (data * z) * LORA_SEQ
            per_step = predict_comm_bytes(cfg, GridShape(data, z, y, x), tokens, accum,
                                          variant.get("ckpt", False), residual_bytes=4,
                                          adapter=AdapterConfig(**{
                                              k: v for k, v in variant.items()
                                              if k in AdapterConfig.__dataclass_fields__}))
            predicted = {k: v * LORA_STEPS for k, v in per_step.items()}
            recorded = {k: r["ledger"][k] for k in ("x", "y", "z", "data")}
            assert predicted == recorded, f"{label}: planner {predicted} != ledger {recorded}"
        if r["variant"].get("dropout"):
            continue  # masks are keyed by grid position: not the one-process masks
        assert r["init_diff"] == 0.0, f"{label}: the adapter starts differently"
        assert r["max_loss_diff"] < 1e-5, f"{label}: losses {r['losses']} vs {r['ref_losses']}"
        # SGD: about 1e-7 measured; AdamW with a larger eps (see lora_worker.train: at eps =
        # 1e-8 it magnifies the last-bit noise of another GEMM order in near-zero gradients
        # into 1.25e-4 over 20 steps; the losses agree within 4e-6 at any eps)
        tol = 1e-5
        assert r["max_adapter_diff"] < tol, \
            f"{label}: {r['worst_adapter']} differs by {r['max_adapter_diff']}"
        assert r["loss_drop"] > 0.05, f"{label}: did not learn: {r['ref_losses']}"
        assert r["adapter_moved"] > 1e-3, label


# ---- one process: config, errors, Hugging Face ----------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["adapter.kind=lora", "adapter.targets=q,kk"], "'kk' is not a layer"),
    (["adapter.kind=lora", "adapter.r=97", "model.preset=debug"],
     "adapter.r = 97: must be from 1 to 96, the smaller dimension of the 'k' layer (192 -> 96)"),
    (["adapter.kind=lora", "model.init_from=/nonexistent/ckpt"], "model.init_from = '/nonexistent"),
    (["adapter.kind=lorra"], "adapter.kind = 'lorra': choose one of none, lora, norm"),
    (["adapter.kind=lora", "adapter.dropout=1.0"], "adapter.dropout = 1.0"),
])
def test_bad_adapter_config_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_adapter_config_reads_targets_from_set_and_toml(tmp_path: Path) -> None:
    cfg = load_config(None, ["adapter.kind=lora", "adapter.targets=q, v,output"])
    assert cfg.adapter.targets == ["q", "v", "output"]
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path).adapter == cfg.adapter
    assert load_config(None).adapter.kind == "none"


def test_a_target_the_model_lacks_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError, match="the model has no 'q' layer"):
        apply_adapter(model, AdapterConfig(kind="lora", targets=["q"]), seed=0)


def test_norm_tuning_trains_only_the_gains() -> None:
    model = build_model(model_config("debug", n_layers=1), seed=1)
    names = apply_adapter(model, AdapterConfig(kind="norm"), seed=0)
    assert names == ["layers.0.attn_norm.weight", "layers.0.ffn_norm.weight", "norm.weight"]
    names = apply_adapter(model, AdapterConfig(kind="norm", train_output=True), seed=0)
    assert names[-1] == "output.weight"


def _tiny_adapted_model(acfg: AdapterConfig, seed: int = 3):
    cfg = model_config("debug", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128,
                       vocab_size=96, max_seq_len=32)
    model = build_model(cfg, seed=seed)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = apply_adapter(model, acfg, seed=5)
    with torch.no_grad():  # B starts at zero, the gains at one: give them values, as training
        g = torch.Generator().manual_seed(9)
        for name, p in model.named_parameters():
            if name in trainable and not name.endswith("lora_A.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return cfg, model, base


PEFT_ADAPTERS = [
    AdapterConfig(kind="lora", r=4, alpha=12.0, targets=ALL_TARGETS),
    # the tuned gains are peft's modules_to_save
    AdapterConfig(kind="lora", r=4, alpha=12.0, targets=["q", "v", "down"], train_norms=True),
    AdapterConfig(kind="norm"),  # peft's LN tuning
    AdapterConfig(kind="norm", train_output=True),  # lm_head a module to save
]


@pytest.mark.parametrize("acfg", PEFT_ADAPTERS, ids=["lora", "lora+norms", "norm", "norm+output"])
def test_peft_and_merged_checkpoints_give_fourfold_logits(acfg: AdapterConfig, tmp_path: Path
                                                          ) -> None:
    import peft  # the test extra installs it
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    cfg, model, base = _tiny_adapted_model(acfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        ours = model(tokens)
        plain = build_model(cfg, seed=3)(tokens)
    assert float((ours - plain).abs().max()) > 1e-2  # the adapter changes the logits

    base_dir = tmp_path / "base"
    base_dir.mkdir()
    save_file({k: v.contiguous() for k, v in state_dict_to_hf(base, cfg).items()},
              str(base_dir / "model.safetensors"))
    (base_dir / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    adapter_dir = tmp_path / "adapter"
    full = model.state_dict()
    save_peft_adapter(full, acfg, adapter_dir, base_model=str(base_dir))
    expected_type = "LORA" if acfg.kind == "lora" else "LN_TUNING"
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["peft_type"] \
        == expected_type
    hf = LlamaForCausalLM.from_pretrained(base_dir).eval()
    peft_model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=tokens).logits
    assert float((theirs - ours).abs().max()) < 1e-4

    merged_dir = tmp_path / "merged"
    save_merged_hf(full, acfg, cfg, merged_dir)
    merged = LlamaForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        theirs = merged(input_ids=tokens).logits
    assert float((theirs - ours).abs().max()) < 1e-4
    assert not any("lora" in k for k in merged_state_dict(full, acfg))


def test_tuned_output_tied_to_the_embedding_has_no_peft_files(tmp_path: Path) -> None:
    acfg = AdapterConfig(kind="norm", train_output=True)
    with pytest.raises(ConfigError, match="train_output = true with tied embeddings"):
        save_peft_adapter({}, acfg, tmp_path, tie_embeddings=True)


def test_the_fine_tuning_corpus_is_another_part_of_the_stdlib() -> None:
    from fourfold.data.builtin import stdlib_files

    modules, tests = stdlib_files(), stdlib_files(tests=True)
    assert modules and tests and not set(modules) & set(tests)
    assert all({"test", "tests"} & set(p.parts) for p in tests)


@pytest.mark.slow
def test_fine_tune_a_converted_run_with_lora_end_to_end(tmp_path: Path, fourfold_cache: Path
                                                        ) -> None:
    """Pretrain briefly, convert to Hugging Face, LoRA-fine-tune from that checkpoint with the
    trainer; the run's model is the merged one and its adapter/ loads in peft alike."""
    import peft  # the test extra installs it
    from transformers import LlamaForCausalLM

    from fourfold.cli import main as fourfold_main
    from fourfold.train.runs import load_trained
    from fourfold.train.trainer import Trainer, TrainingError

    common = ["model.preset=debug", "train.batch_size=8", "train.seq_len=32", "train.steps=4",
              "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=0",
              "train.sample_tokens=0", "train.log_every=1"]
    Trainer(load_config(None, common), tmp_path / "pre", progress=False).fit()
    assert fourfold_main(["convert", str(tmp_path / "pre"), "--to", "hf",
                          str(tmp_path / "hf")]) == 0
    # fine-tuned on another part of the built-in corpus, as examples/lora.toml
    lora = [f"model.init_from={tmp_path / 'hf'}", "adapter.kind=lora", "adapter.r=4",
            "train.lr=1e-2", "checkpoint.every=2", "checkpoint.async=false",
            "data.path=builtin:stdlib-tests"]
    cfg = load_config(None, common + lora)
    trainer = Trainer(cfg, tmp_path / "lora", progress=False)
    trainable = [n for n, p in trainer.pmodel.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    trainer.fit()
    # a base that changed since the adapter's checkpoints were written: refused in one line
    base_file = tmp_path / "hf" / "model.safetensors"
    stat = base_file.stat()
    os.utime(base_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(TrainingError) as e:
        Trainer(load_config(None, common + lora + ["train.steps=6"]), tmp_path / "lora",
                progress=False)
    assert "changed since the adapter checkpoint" in str(e.value) and "\n" not in str(e.value)
    os.utime(base_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    model, _ = load_trained(tmp_path / "lora")  # merged: a plain Llama, no adapter code
    tokens = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(0))
    tuned = trainer.pmodel.module.eval()
    with torch.no_grad():
        ours = tuned(tokens)
        assert float((model(tokens) - ours).abs().max()) < 1e-4
        hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
        before = hf(input_ids=tokens).logits
        adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "lora" / "adapter").eval()
        theirs = adapted(input_ids=tokens).logits
    assert float((before - ours).abs().max()) > 1e-3  # fine-tuning changed the model
    assert float((theirs - ours).abs().max()) < 1e-4

    # the run's streamed merge is the whole-state merge, and convert --merge writes it
    from safetensors.torch import load_file
    written = load_file(str(tmp_path / "lora" / "model.safetensors"))
    expected = merged_state_dict(trainer.pmodel.module.state_dict(), cfg.adapter)
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[n], expected[n]) for n in written)
    assert fourfold_main(["convert", str(tmp_path / "lora"), "--to", "hf",
                          str(tmp_path / "merged"), "--merge"]) == 0
    converted = load_file(str(tmp_path / "merged" / "model.safetensors"))
    as_hf = state_dict_to_hf(written, trainer.cfg.model)
    assert sorted(converted) == sorted(as_hf)
    assert all(torch.equal(converted[n], as_hf[n]) for n in converted)
    with torch.no_grad():
        merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert float((merged(input_ids=tokens).logits - ours).abs().max()) < 1e-4
        # without --merge: the base checkpoint, and the adapter beside it
        assert fourfold_main(["convert", str(tmp_path / "lora"), "--to", "hf",
                              str(tmp_path / "apart")]) == 0
        base = LlamaForCausalLM.from_pretrained(tmp_path / "apart").eval()
        apart = peft.PeftModel.from_pretrained(base, tmp_path / "apart" / "adapter").eval()
        assert float((apart(input_ids=tokens).logits - ours).abs().max()) < 1e-4
    assert json.loads((tmp_path / "apart" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(tmp_path / "apart")
    # --merge of a run without an adapter: one line, exit 2
    assert fourfold_main(["convert", str(tmp_path / "pre"), "--to", "hf",
                          str(tmp_path / "x"), "--merge"]) == 2


@pytest.mark.slow
def test_a_lora_run_resumes_from_its_checkpoint(tmp_path: Path, fourfold_cache: Path) -> None:
    from fourfold.train.trainer import Trainer

    common = ["model.preset=debug", "train.batch_size=8", "train.seq_len=32",
              "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=0",
              "train.sample_tokens=0", "train.log_every=1", "adapter.kind=lora", "adapter.r=4",
              "train.lr=1e-2", "checkpoint.every=2", "checkpoint.async=false"]
    whole = Trainer(load_config(None, common + ["train.steps=4"]), tmp_path / "a",
                    progress=False).fit()
    Trainer(load_config(None, common + ["train.steps=4"]), tmp_path / "b",
            progress=False).fit()
    # the checkpoints hold the adapter and its optimizer state, not the frozen base again
    from fourfold.train.checkpoint import list_checkpoints, step_of
    base_bytes = (tmp_path / "a" / "model.safetensors").stat().st_size
    for path in list_checkpoints(tmp_path / "a"):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        # (the adapter is 2.7% of this tiny model; AdamW state and RNG states add the rest)
        assert size < base_bytes / 5, f"{path}: {size} bytes, the base has {base_bytes}"
    # the same run again from its step-2 checkpoint: drop the finished model, keep step 2
    for path in list_checkpoints(tmp_path / "b"):
        if step_of(path) == 4:
            shutil.rmtree(path)
    (tmp_path / "b" / "model.safetensors").unlink()
    resumed = Trainer(load_config(None, common + ["train.steps=4"]), tmp_path / "b",
                      progress=False)
    assert resumed.step == 2
    # a run without its model file: the base rebuilt, the checkpoint's adapter merged in
    from fourfold.models.adapter import merged_state_dict
    from fourfold.train.runs import load_trained
    model, cfg = load_trained(tmp_path / "b")
    expected = merged_state_dict(resumed.pmodel.module.state_dict(), cfg.adapter)
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name
    result = resumed.fit()
    assert result.final_loss == pytest.approx(whole.final_loss, abs=1e-6)


@pytest.mark.ranks
@pytest.mark.usefixtures("one_thread")
def test_a_grid_adapter_run_writes_the_one_process_files(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On x = 2 the merged model streams from both ranks: the same model.safetensors and
    adapter/ (LoRA factors and the gains as modules_to_save) as one process."""
    from safetensors.torch import load_file

    from conftest import outside_job_env
    from fourfold.train.trainer import Trainer
    from test_train_multirank import torchrun_train

    items = ["model.preset=debug", "train.batch_size=8", "train.seq_len=32", "train.steps=3",
             "train.eval_every=0", "train.eval_batches=0", "train.sample_tokens=0",
             "adapter.kind=lora", "adapter.r=4", "adapter.train_norms=true", "train.lr=1e-2"]
    env = outside_job_env(FOURFOLD_CACHE=str(tmp_path / "cache"))
    torchrun_train([*items, "parallel.x=2"], tmp_path / "grid", env)
    monkeypatch.setenv("FOURFOLD_CACHE", env["FOURFOLD_CACHE"])
    Trainer(load_config(None, items), tmp_path / "one", progress=False).fit()
    for file in ("model.safetensors", "adapter/adapter_model.safetensors"):
        grid, one = load_file(str(tmp_path / "grid" / file)), load_file(str(tmp_path / "one" / file))
        assert sorted(grid) == sorted(one), file
        for name in one:
            torch.testing.assert_close(grid[name], one[name], rtol=0, atol=1e-5)
