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
from grid_cases import launch_grid_cases

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models; a busy machine
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
    """A random tiny LlamaForCausalLM saved by transformers into `root`, its config.json then
    written in the spelling asked for: Transformers 5's (rope_parameters, rope_theta inside)
    or 4's (rope_theta, rope_scaling)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_hf_config(rope_scaling=rope, **fields))).eval()
    with torch.no_grad():  # non-trivial norms, so that a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(root)
    config_file = root / "config.json"
    saved = json.loads(config_file.read_text())
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        saved.pop(key, None)
    if spelling == "rope_scaling":
        saved.update(rope_theta=THETA, rope_scaling=rope)
    else:
        saved["rope_parameters"] = {"rope_type": "default", **(rope or {}), "rope_theta": THETA}
    config_file.write_text(json.dumps(saved))
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
    results = launch_grid_cases(WORKER, 2, GRIDS, "FOURFOLD_TEST_CASES", "case", cases,
                                tmp_path / "results.jsonl")
    for r in results:
        assert r["max_diff"] < 1e-5, r


# --------------------------------------------------------------------------------------------
# Export: fourfold convert RUN --to hf OUT


EXPORT_FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json"}
TEXTS = ["def f(x):\n    return x\n", "héllo wörld 日本 🎉\t  spaces  ", "\n\n", "a"]


def assert_export_matches(out_dir: Path, model: torch.nn.Module, texts: list[str],
                          tokenizer: Any = None) -> None:
    """What a transformers user does with an export: AutoTokenizer and AutoModelForCausalLM
    from the folder. Its ids for each text are fourfold's (the run's tokenizer, byte when
    None), its logits fourfold's within 1e-5 in float32, and its special ids the tokenizer's
    EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fourfold.data.tokenizers import ByteTokenizer

    ours_tok = tokenizer or ByteTokenizer()
    theirs_tok = AutoTokenizer.from_pretrained(out_dir)
    assert theirs_tok.eos_token_id == ours_tok.eos_id
    hf = AutoModelForCausalLM.from_pretrained(out_dir).float().eval()
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == ours_tok.eos_id
    for text in texts:
        ids = theirs_tok(text).input_ids
        assert ids == ours_tok.encode(text).tolist()
        assert theirs_tok.decode(ids + [ours_tok.eos_id], skip_special_tokens=True) == text
        with torch.no_grad():
            batch = torch.tensor([ids])
            diff = float((hf(batch).logits - model.eval()(batch)).abs().max())
        assert diff < 1e-5


def hand_written_run(run: Path, overrides: list[str]) -> torch.nn.Module:
    """A RUN_DIR made without training: config.toml and model.safetensors of a random model
    with non-trivial norms and biases (so that a mix-up shows)."""
    from fourfold.train.runs import save_weights

    cfg = load_config(None, ["model.preset=debug", *overrides])
    run.mkdir(parents=True)
    cfg.save(run / "config.toml")
    model = build_model(cfg.model, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    save_weights(model.state_dict(), run / "model.safetensors", cfg.model.tie_embeddings)
    return model.eval()


LLAMA3_RUN = ["model.rope_scaling=llama3", "model.rope_factor=8",
              "model.rope_original_max_seq_len=64", "model.rope_theta=500000"]


def test_convert_a_byte_run_loads_in_one_line(tmp_path: Path) -> None:
    from fourfold.cli import main

    model = hand_written_run(tmp_path / "run", [*LLAMA3_RUN, "model.tie_embeddings=true",
                                                "model.bias=true", "model.n_kv_heads=1"])
    assert main(["convert", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert {p.name for p in (tmp_path / "hf").iterdir()} == EXPORT_FILES
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 256)
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 1
    assert_export_matches(tmp_path / "hf", model, TEXTS)


def test_the_byte_tokenizer_for_transformers_encodes_as_fourfolds() -> None:
    from fourfold.data.tokenizers import ByteTokenizer, byte_level_hf_tokenizer

    ours, theirs = ByteTokenizer(), byte_level_hf_tokenizer()
    rng = torch.Generator().manual_seed(0)
    texts = TEXTS + ["".join(chr(int(c)) for c in torch.randint(1, 0x2FFF, (200,),
                                                                generator=rng))]
    for text in texts:
        assert theirs.encode(text).ids == ours.encode(text).tolist()
    assert theirs.token_to_id("<|endoftext|>") == ours.eos_id == 256
    # bytes that are no UTF-8 (a character cut short, a stray continuation byte) decode alike
    for ids in ([104, 195], [0xE6, 0x97, 104, 0x80, 105], list(range(256)), [104, 256, 105]):
        assert theirs.decode(ids) == ours.decode(ids)


def test_convert_a_bpe_run_writes_its_tokenizer(tmp_path: Path) -> None:
    from fourfold.cli import main
    from fourfold.data import load_tokenizer, prepare

    (tmp_path / "text.txt").write_text("".join(TEXTS) * 50)
    prepare([tmp_path / "text.txt"], tmp_path / "data", tokenizer="bpe:300", progress=False)
    tokenizer = load_tokenizer(tmp_path / "data")
    # data.tokenizer = "byte": what a run recorded before "auto" was the default, whatever
    # its data held; the run's tokenizer is its data's own
    model = hand_written_run(tmp_path / "run", [f"data.path={tmp_path / 'data'}",
                                                "data.tokenizer=byte",
                                                "model.rope_scaling=linear",
                                                "model.rope_factor=2"])
    assert main(["convert", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == \
        (tmp_path / "data" / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"] == \
        {"rope_type": "linear", "factor": 2.0}
    assert_export_matches(tmp_path / "hf", model, TEXTS, tokenizer)


def test_convert_refuses_a_non_empty_out_unless_overwrite(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fourfold.cli import main

    model = hand_written_run(tmp_path / "run", [])
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["convert", str(tmp_path / "run"), "--to", "hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: OUT_DIR ") and err.count("\n") == 1 and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert main(["convert", str(tmp_path / "run"), "--to", "hf", str(out), "--overwrite"]) == 0
    assert {p.name for p in out.iterdir()} == EXPORT_FILES  # nothing of the old OUT_DIR left
    assert_export_matches(out, model, ["x = 1"])
    for where in (tmp_path / "run", tmp_path):  # the run itself, or a folder holding it
        assert main(["convert", str(tmp_path / "run"), "--to", "hf", str(where),
                     "--overwrite"]) == 2
        assert "holds the run" in capsys.readouterr().err
    assert (tmp_path / "run" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


@pytest.mark.slow
def test_convert_adapter_runs_merged_and_apart(tmp_path: Path) -> None:
    """A run trained from scratch, exported; a LoRA run on that export, exported merged and
    as the base with the adapter beside it: each loads with AutoTokenizer and
    AutoModelForCausalLM (and peft) and computes fourfold's logits."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fourfold.cli import main
    from fourfold.data import load_tokenizer, prepare
    from fourfold.train.runs import load_trained
    from fourfold.train.trainer import Trainer

    (tmp_path / "texts").mkdir()
    for i in range(40):  # documents enough for a validation split
        (tmp_path / "texts" / f"{i}.txt").write_text(f"{i} " + "".join(TEXTS) * 5)
    prepare([tmp_path / "texts"], tmp_path / "data", tokenizer="bpe:300", progress=False,
            val_fraction=0.1)
    tokenizer = load_tokenizer(tmp_path / "data")
    common = ["model.preset=debug", f"data.path={tmp_path / 'data'}", "train.batch_size=4",
              "train.seq_len=32", "train.steps=2", "train.warmup_steps=1",
              "train.eval_every=0", "train.eval_batches=0", "train.sample_tokens=0",
              "train.device=cpu", *LLAMA3_RUN]
    Trainer(load_config(None, common), tmp_path / "pre", progress=False).fit()
    assert main(["convert", str(tmp_path / "pre"), "--to", "hf", str(tmp_path / "base")]) == 0
    assert_export_matches(tmp_path / "base", load_trained(tmp_path / "pre")[0], TEXTS[:1],
                          tokenizer)
    lora = [f"model.init_from={tmp_path / 'base'}", "adapter.kind=lora", "adapter.r=4",
            "train.lr=3e-2"]
    Trainer(load_config(None, common + lora), tmp_path / "lora", progress=False).fit()
    tuned, cfg = load_trained(tmp_path / "lora")
    assert cfg.model.rope_scaling == "llama3"  # read back from the base's config.json
    assert main(["convert", str(tmp_path / "lora"), "--to", "hf", str(tmp_path / "merged"),
                 "--merge"]) == 0
    assert_export_matches(tmp_path / "merged", tuned, TEXTS[:1], tokenizer)
    assert main(["convert", str(tmp_path / "lora"), "--to", "hf", str(tmp_path / "apart")]) == 0
    ids = AutoTokenizer.from_pretrained(tmp_path / "apart")(TEXTS[0]).input_ids
    assert ids == tokenizer.encode(TEXTS[0]).tolist()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "apart").float().eval()
    batch = torch.tensor([ids])
    with torch.no_grad():
        assert float((base(batch).logits - tuned(batch)).abs().max()) > 1e-4  # it trained
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "apart" / "adapter").eval()
        assert float((adapted(input_ids=batch).logits - tuned(batch)).abs().max()) < 1e-5
