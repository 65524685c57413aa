"""Hugging Face checkpoints in and out: RoPE scaling (Llama 3's and linear) read from either
spelling of config.json and computed as transformers computes it, on one process and on a
grid; every config.json field that would change the math and that fourfold does not model
refused in one line; a Hub name refused with how to download it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fourfold.config import ConfigError, ParallelConfig, load_config, model_config
from fourfold.models.hf import (InitFromError, config_from_hf, config_to_hf, hf_model_config,
                                load_hf_into)
from fourfold.models.llama import build_model, rope_frequencies
from fourfold.parallel import Grid, parallelize
from fourfold.train.sampling import generate

from conftest import outside_job_env

VOCAB, SEQ = 96, 48
# Llama 3's scaling with a short original context, so that each of its three bands (kept,
# blended, divided) holds some of the 8 frequencies of a 16-wide head
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}
THETA = 500000.0


def tiny_hf_config(**fields: Any) -> dict[str, Any]:
    """config.json of a small Llama, Transformers 4's spelling (rope_theta at the top)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5, "rope_theta": THETA, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, **fields}


def save_tiny_hf(root: Path, rope: dict[str, Any] | None, spelling: str = "rope_parameters",
                 **fields: Any) -> LlamaForCausalLM:
    """A random tiny LlamaForCausalLM saved by transformers into `root` (which writes
    Transformers 5's rope_parameters); with spelling="rope_scaling" its config.json is then
    rewritten as Transformers 4 wrote it."""
    hf_fields = tiny_hf_config(**fields)
    hf_fields.pop("rope_theta")
    params = {"rope_type": "default", **(rope or {}), "rope_theta": THETA}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**hf_fields, rope_parameters=params)).eval()
    with torch.no_grad():  # non-trivial norms, so that a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(root)
    config_file = root / "config.json"
    saved = json.loads(config_file.read_text())
    if spelling == "rope_scaling":
        table = saved.pop("rope_parameters")
        saved["rope_theta"] = table.pop("rope_theta")
        saved["rope_scaling"] = None if table["rope_type"] == "default" else table
        config_file.write_text(json.dumps(saved))
    else:
        assert "rope_parameters" in saved and "rope_scaling" not in saved
    return model


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))


def fourfold_from(root: Path) -> torch.nn.Module:
    """A fourfold Llama read from a Hugging Face folder as `model.init_from` reads it."""
    cfg = hf_model_config(root)
    model = build_model(cfg, seed=0, device="meta")
    load_hf_into(parallelize(model, Grid.single(), ParallelConfig(gemm_tuning=False)), root)
    return model.eval()


@pytest.mark.parametrize("rope", [LLAMA3, LINEAR], ids=["llama3", "linear"])
@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_scaled_rope_logits_equal_transformers(rope: dict, spelling: str,
                                               tmp_path: Path) -> None:
    hf = save_tiny_hf(tmp_path, rope, spelling)
    cfg = hf_model_config(tmp_path)
    assert cfg.rope_scaling == rope["rope_type"] and cfg.rope_factor == rope["factor"]
    assert cfg.rope_theta == THETA
    ours = fourfold_from(tmp_path)
    with torch.no_grad():
        theirs = hf(tokens()).logits
        diff = float((ours(tokens()) - theirs).abs().max())
        # the same weights with plain RoPE: what fourfold computed before it read the scaling
        plain = build_model(dataclasses.replace(cfg, rope_scaling="none", rope_factor=1.0,
                                                rope_original_max_seq_len=8192), seed=0)
        plain.load_state_dict(ours.state_dict())
        unscaled = float((plain.eval()(tokens()) - theirs).abs().max())
    assert diff < 1e-5
    assert unscaled > 1e-3  # the scaling matters at these positions


def test_llama3_frequencies_fall_in_three_bands() -> None:
    cfg = config_from_hf(tiny_hf_config(rope_scaling=LLAMA3))
    plain = rope_frequencies(model_config("debug", dim=64, n_heads=4, rope_theta=THETA))
    scaled = rope_frequencies(cfg)
    ratio = (plain / scaled).tolist()
    assert ratio[0] == 1.0  # short wavelengths kept
    assert all(r == 8.0 for r in ratio[2:])  # long ones divided by the factor
    assert 1.0 < ratio[1] < 8.0  # the one between, blended


def test_greedy_generation_with_llama3_scaling_equals_transformers(tmp_path: Path) -> None:
    hf = save_tiny_hf(tmp_path, LLAMA3)
    ours = fourfold_from(tmp_path)
    prompt = tokens(1)[0, :10]
    with torch.no_grad():
        theirs = hf.generate(prompt[None], attention_mask=torch.ones(1, 10, dtype=torch.long),
                             max_new_tokens=30, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 10:].tolist()
    assert generate(ours, prompt.tolist(), 30, temperature=0) == theirs


def test_config_round_trips_rope_scaling() -> None:
    for fields in ({"rope_scaling": "llama3", "rope_factor": 32.0, "rope_low_freq_factor": 1.0,
                    "rope_high_freq_factor": 4.0, "rope_original_max_seq_len": 8192},
                   {"rope_scaling": "linear", "rope_factor": 2.0}, {}):
        cfg = model_config("1b", **fields)
        written = config_to_hf(cfg, bos_token_id=5, eos_token_id=7)
        assert (written["bos_token_id"], written["eos_token_id"]) == (5, 7)
        back = config_from_hf(json.loads(json.dumps(written)))
        assert {k: v for k, v in vars(back).items() if k != "preset"} == \
            {k: v for k, v in vars(cfg).items() if k != "preset"}


@pytest.mark.parametrize("overrides,names", [
    (["model.rope_factor=2"], "model.rope_factor = 2.0 applies only to model.rope_scaling = "),
    (["model.rope_scaling=linear", "model.rope_high_freq_factor=8"],
     "model.rope_high_freq_factor = 8.0 applies only to model.rope_scaling = 'llama3'"),
    (["model.rope_scaling=yarn"], "model.rope_scaling = 'yarn': choose one of none, linear, "),
    (["model.rope_scaling=linear", "model.rope_factor=0.5"], "model.rope_factor = 0.5"),
    (["model.rope_scaling=llama3", "model.rope_low_freq_factor=4"], "need 0 < low < high"),
    (["model.rope_scaling=llama3", "model.rope_original_max_seq_len=0"],
     "model.rope_original_max_seq_len = 0"),
])
def test_rope_scaling_config_mistakes(overrides: list[str], names: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert names in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# Fields fourfold does not model: one line naming the field


REFUSED = [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type = 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type = 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": THETA}},
     "rope_parameters.rope_type = 'longrope'"),
    ({"rope_scaling": {**LINEAR, "attention_factor": 2.0}}, "rope_scaling.attention_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs high_freq_factor"),
    ({"rope_scaling": LLAMA3, "rope_parameters": {**LINEAR, "rope_theta": THETA}},
     "disagree"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_theta = 500000.0"),
    ({"model_type": "mistral", "sliding_window": 32}, "sliding_window = 32"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"model_type": "qwen2"}, "model_type = 'qwen2'"),
    ({"model_type": "gemma"}, "model_type = 'gemma'"),
    ({"head_dim": 32}, "head_dim = 32"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"attention_bias": True}, "mlp_bias"),
    ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ({"quantization_config": {"quant_method": "gptq"}}, "'quantization_config'"),
    ({"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping'"),
]


@pytest.mark.parametrize("fields,names", REFUSED, ids=[r[1] for r in REFUSED])
def test_fields_that_change_the_math_are_refused(fields: dict, names: str,
                                                 tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config(**fields)))
    with pytest.raises(InitFromError) as e:
        hf_model_config(tmp_path)
    message = str(e.value)
    assert names in message and "\n" not in message
    assert message.startswith(f"model.init_from = {str(tmp_path)!r}: config.json ")


def test_fields_that_do_not_change_the_math_are_read() -> None:
    cfg = config_from_hf(tiny_hf_config(
        model_type="mistral", sliding_window=None, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=True, head_dim=16, hidden_act="silu", pretraining_tp=1,
        torch_dtype="bfloat16", transformers_version="4.45.0", use_cache=True,
        initializer_range=0.02, rope_scaling=None, attention_dropout=0.0))
    assert cfg.bias and cfg.tie_embeddings and cfg.rope_scaling == "none"
    assert config_from_hf(tiny_hf_config(model_type="mistral", sliding_window=4096)
                          ).max_seq_len == 128  # a window over the whole context is no window
    bare = tiny_hf_config()
    del bare["rms_norm_eps"], bare["rope_theta"]
    assert (config_from_hf(bare).norm_eps, config_from_hf(bare).rope_theta) == (1e-6, 1e4)


def test_a_hub_name_is_refused_with_how_to_download_it(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InitFromError) as e:
        hf_model_config("meta-llama/Llama-3.2-1B")
    message = str(e.value)
    assert "\n" not in message and "local folders" in message
    assert "huggingface-cli download meta-llama/Llama-3.2-1B --local-dir DIR" in message
    with pytest.raises(InitFromError, match="does not exist"):
        hf_model_config(tmp_path / "no" / "such" / "dir")


@pytest.mark.slow
def test_train_refuses_a_hub_name_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fourfold", "train", "--set", "model.init_from=meta-llama/Llama-3.2-1B",
         "--set", "train.steps=1", "--out", str(tmp_path / "run")],
        cwd=tmp_path, env=outside_job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.init_from = "), proc.stderr
    assert "huggingface-cli download meta-llama/Llama-3.2-1B" in lines[0]


# --------------------------------------------------------------------------------------------
# On a grid


WORKER = Path(__file__).with_name("hf_worker.py")
GRIDS = [[1, 1, 1, 2], [1, 1, 2, 1], [1, 2, 1, 1]]  # (data, z, y, x): x, y and z of 2


@pytest.mark.ranks
def test_scaled_rope_on_a_two_rank_grid_equals_transformers(tmp_path: Path) -> None:
    cases = []
    for name, rope in (("llama3", LLAMA3), ("linear", LINEAR)):
        root = tmp_path / name
        hf = save_tiny_hf(root, rope)
        with torch.no_grad():
            torch.save({"tokens": tokens(), "logits": hf(tokens()).logits}, root / "expected.pt")
        cases.append({"dir": str(root)})
    out = tmp_path / "results.jsonl"
    env = outside_job_env(FOURFOLD_TEST_SHAPES=json.dumps(GRIDS),
                          FOURFOLD_TEST_CASES=json.dumps(cases), FOURFOLD_TEST_OUT=str(out),
                          OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--standalone", str(WORKER)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == len(GRIDS) * len(cases)
    for r in results:
        assert r.get("ok"), r.get("error")
        assert r["max_diff"] < 1e-5, r
