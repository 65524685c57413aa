"""Mapping between fourfold's Llama and Hugging Face LlamaForCausalLM (and Mistral checkpoints,
which share its layout), and the files on both sides: reading a local HF checkpoint into a
(parallel) model, and writing a trained model as one. Both use the rotate-half RoPE layout, so
weights move by name alone, without permutation. A config.json field that would make the HF
model compute something fourfold's does not is refused by name (config_from_hf)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from fourfold.config import ConfigError, ModelConfig
from fourfold.errors import first_line
from fourfold.files import atomic_write_text
from fourfold.safetensors_stream import TensorSpec, write_streamed

if TYPE_CHECKING:
    from fourfold.parallel import ParallelModel

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"


class InitFromError(ConfigError):
    """model.init_from names something that is not a usable Hugging Face checkpoint."""

# fourfold name pattern -> HF name pattern ({i} is the layer index)
_LAYER_MAP = {
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"layers.{{i}}.attn.{p}_proj.{t}": f"model.layers.{{i}}.self_attn.{p}_proj.{t}"
       for p in "qkvo" for t in ("weight", "bias")},
    **{f"layers.{{i}}.ffn.{p}_proj.{t}": f"model.layers.{{i}}.mlp.{p}_proj.{t}"
       for p in ("gate", "up", "down") for t in ("weight", "bias")},
}
_GLOBAL_MAP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def fourfold_to_hf_name(name: str) -> str:
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    if m:
        key = "layers.{i}." + m.group(2)
        if key in _LAYER_MAP:
            return _LAYER_MAP[key].format(i=m.group(1))
    raise KeyError(f"no Hugging Face name for fourfold parameter {name!r}")


def hf_to_fourfold_name(name: str) -> str:
    for ours, theirs in _GLOBAL_MAP.items():
        if name == theirs:
            return ours
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m:
        key = "model.layers.{i}." + m.group(2)
        for ours, theirs in _LAYER_MAP.items():
            if theirs == key:
                return ours.format(i=m.group(1))
    raise KeyError(f"unknown Hugging Face parameter {name!r}")


def state_dict_from_hf(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig
                       ) -> dict[str, torch.Tensor]:
    """An HF Llama state dict renamed for fourfold's Llama (rotary buffers are dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if "rotary_emb" in name:
            continue
        out[hf_to_fourfold_name(name)] = tensor
    if cfg.tie_embeddings:
        out.setdefault("output.weight", out["embed.weight"])
    return out


def state_dict_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig
                     ) -> dict[str, torch.Tensor]:
    out = {fourfold_to_hf_name(k): v for k, v in state.items() if not k.startswith("rope_")}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


# config.json fields that do not change what the model computes: Transformers' bookkeeping,
# token ids, initialisation, generation defaults of older configs. Any field neither here nor
# read by config_from_hf is refused: fourfold cannot tell whether it changes the math.
_NEUTRAL_HF_FIELDS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "tokenizer_class", "pretraining_tp",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
    "finetuning_task", "id2label", "label2id", "num_labels", "task_specific_params",
    "problem_type", "prefix", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "_attn_implementation", "attn_implementation",
})
# What fourfold reads; with the neutral fields, everything a Llama or Mistral config may hold.
_READ_HF_FIELDS = frozenset({
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
    "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "tie_word_embeddings", "rms_norm_eps", "attention_bias",
    "mlp_bias", "hidden_act", "attention_dropout", "sliding_window", "layer_types",
})
HF_MODEL_TYPES = ("llama", "mistral")  # decoders whose forward is fourfold's Llama
# rope_type -> the keys of its rope_scaling / rope_parameters table and their ModelConfig field
_ROPE_KEYS = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_seq_len"},
}


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from an HF config.json dict (Llama, Mistral). A field whose value fourfold
    does not compute (another RoPE scaling, a sliding window that can bind, biases on some
    projections only, another activation, a head size apart from hidden_size / heads, ...) or
    does not know raises ValueError naming it: fourfold refuses a model rather than run
    another one. Absent fields take LlamaConfig's defaults."""
    unknown = sorted(set(hf_config) - _READ_HF_FIELDS - _NEUTRAL_HF_FIELDS)
    if unknown:
        raise ValueError(f"field {unknown[0]!r} is not one fourfold models (it reads "
                         f"{', '.join(HF_MODEL_TYPES)} configs)")
    get = hf_config.get
    model_type = get("model_type", "llama")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"model_type = {model_type!r}: fourfold models "
                         f"{' and '.join(HF_MODEL_TYPES)} checkpoints")
    n_heads, dim = hf_config["num_attention_heads"], hf_config["hidden_size"]
    if dim % n_heads:
        raise ValueError(f"num_attention_heads = {n_heads} does not divide hidden_size = {dim}")
    if get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"head_dim = {get('head_dim')}: fourfold's heads are hidden_size / "
                         f"num_attention_heads = {dim // n_heads} wide")
    if get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act = {get('hidden_act')!r}: fourfold's MLP is SwiGLU (silu)")
    bias = bool(get("attention_bias", False))
    if bool(get("mlp_bias", False)) != bias:
        raise ValueError(f"attention_bias = {bias} but mlp_bias = {get('mlp_bias')}: fourfold "
                         "puts biases on all projections or on none")
    if get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout = {get('attention_dropout')}: fourfold's attention "
                         "has no dropout")
    if get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor = {get('partial_rotary_factor')}: fourfold "
                         "rotates every dimension of a head")
    max_seq_len = get("max_position_embeddings", 2048)
    window = get("sliding_window")
    if window is not None and window < max_seq_len:
        raise ValueError(f"sliding_window = {window}: fourfold's attention sees the whole "
                         f"context (max_position_embeddings = {max_seq_len})")
    kinds = set(get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"layer_types = {sorted(kinds)}: fourfold's layers all use "
                         "full_attention")
    return ModelConfig(
        preset="custom",
        n_layers=hf_config["num_hidden_layers"], dim=dim, n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads,
        ffn_dim=hf_config["intermediate_size"], vocab_size=hf_config["vocab_size"],
        max_seq_len=max_seq_len,
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        bias=bias,
        **_rope_from_hf(hf_config),
    )


def _rope_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig's rope_* fields from either spelling of config.json: Transformers 4's
    rope_theta with a rope_scaling table (rope_type or type), or 5's rope_parameters table
    with rope_theta inside. Two that disagree are refused (the versions read them apart)."""
    tables = {name: dict(hf_config[name]) for name in ("rope_scaling", "rope_parameters")
              if hf_config.get(name) is not None}
    described = {name: _rope_fields(name, table, hf_config.get("rope_theta"))
                 for name, table in tables.items()}
    if len(described) == 2 and described["rope_scaling"] != described["rope_parameters"]:
        raise ValueError(f"rope_scaling = {tables['rope_scaling']} and rope_parameters = "
                         f"{tables['rope_parameters']} disagree")
    if described:
        return next(iter(described.values()))
    return {"rope_theta": float(hf_config.get("rope_theta", 10000.0))}


def _rope_fields(name: str, table: dict[str, Any], top_theta: Any) -> dict[str, Any]:
    if "type" in table and table.setdefault("rope_type", table["type"]) != table["type"]:
        raise ValueError(f"{name}: type = {table['type']!r} and rope_type = "
                         f"{table['rope_type']!r} disagree")
    table.pop("type", None)
    kind = table.pop("rope_type", "default")
    if kind not in _ROPE_KEYS:
        raise ValueError(f"{name}.rope_type = {kind!r}: fourfold models RoPE scaling of type "
                         f"{', '.join(k for k in _ROPE_KEYS if k != 'default')} (or none)")
    theta = table.pop("rope_theta", top_theta)
    if top_theta is not None and theta != top_theta:
        raise ValueError(f"rope_theta = {top_theta} and {name}.rope_theta = {theta} disagree")
    keys = _ROPE_KEYS[kind]
    extra = sorted(set(table) - set(keys))
    if extra:
        raise ValueError(f"{name}.{extra[0]} = {table[extra[0]]!r}: not part of RoPE scaling "
                         f"of type {kind!r}, which fourfold models with "
                         f"{', '.join(keys) or 'no parameters'}")
    missing = sorted(set(keys) - set(table))
    if missing:
        raise ValueError(f"{name}: rope_type {kind!r} needs {missing[0]}")
    fields = {field: table[key] for key, field in keys.items()}
    if "rope_original_max_seq_len" in fields:
        fields["rope_original_max_seq_len"] = int(fields["rope_original_max_seq_len"])
    if "rope_factor" in fields:
        fields["rope_factor"] = float(fields["rope_factor"])
    return {"rope_theta": float(10000.0 if theta is None else theta),
            "rope_scaling": "none" if kind == "default" else kind, **fields}


def config_to_hf(cfg: ModelConfig, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict[str, Any]:
    """An HF LlamaConfig dict (config.json) for fourfold's model config, with the tokenizer's
    special token ids where given. RoPE scaling is written as Transformers 4 spells it
    (rope_theta and a rope_scaling table), which Transformers 5 reads as well."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling_to_hf(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias, "hidden_act": "silu", "torch_dtype": "float32",
        **({} if bos_token_id is None else {"bos_token_id": bos_token_id}),
        **({} if eos_token_id is None else {"eos_token_id": eos_token_id}),
    }


def rope_scaling_to_hf(cfg: ModelConfig) -> dict[str, Any] | None:
    """config.json's rope_scaling table for cfg (None without scaling)."""
    if cfg.rope_scaling == "none":
        return None
    keys = _ROPE_KEYS[cfg.rope_scaling]
    return {"rope_type": cfg.rope_scaling, **{key: getattr(cfg, field)
                                              for key, field in keys.items()}}


# --------------------------------------------------------------------------------------------
# Reading a local Hugging Face checkpoint (model.init_from)


def check_local_checkpoint(path: str | Path) -> Path:
    """`path` as a directory, or InitFromError (one line) when nothing is there: for a name
    such as meta-llama/Llama-3.2-1B, how to download it, since fourfold never downloads."""
    root = Path(path).expanduser()
    if root.is_dir():
        return root
    if root.exists():
        raise InitFromError(f"model.init_from = {str(path)!r} is a file; expected a local "
                            "Hugging Face checkpoint directory")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(path)):
        raise InitFromError(f"model.init_from = {str(path)!r}: no such local folder; fourfold "
                            "reads local folders, not the Hugging Face Hub: download it first "
                            f"(huggingface-cli download {path} --local-dir DIR) and set "
                            "model.init_from = DIR")
    raise InitFromError(f"model.init_from = {str(path)!r} does not exist; expected a local "
                        "Hugging Face checkpoint directory")


def hf_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a local Hugging Face checkpoint directory (config.json); InitFromError
    (one line) naming the first field of it that fourfold does not model."""
    config_file = check_local_checkpoint(path) / HF_CONFIG_FILE
    if not config_file.is_file():
        raise InitFromError(f"model.init_from = {str(path)!r}: no config.json there; expected a "
                            "local Hugging Face checkpoint directory")
    try:
        hf_config = json.loads(config_file.read_text())
    except ValueError as e:
        raise InitFromError(f"model.init_from = {str(path)!r}: config.json is not valid JSON "
                            f"({first_line(e)})") from None
    try:
        if not isinstance(hf_config, dict):
            raise ValueError("is not a JSON object")
        return config_from_hf(hf_config)
    except KeyError as e:
        raise InitFromError(f"model.init_from = {str(path)!r}: config.json has no {e} field"
                            ) from None
    except (ValueError, TypeError) as e:
        raise InitFromError(f"model.init_from = {str(path)!r}: config.json {first_line(e)}"
                            ) from None


def _hf_weight_files(root: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded index)."""
    root = check_local_checkpoint(root)
    index = root / HF_WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / HF_WEIGHTS_FILE
    if not single.is_file():
        raise InitFromError(f"model.init_from = {str(root)!r}: no model.safetensors or "
                            "model.safetensors.index.json there (only safetensors are read)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_hf_into(pmodel: ParallelModel, path: str | Path) -> None:
    """Fill every local shard of `pmodel` from a local Hugging Face safetensors checkpoint.
    Each rank reads only the slices it owns (never the full model). Works for fourfold's Llama
    (names mapped) and for HF modules parallelized directly (names as they are).

    Reads `pmodel`'s named_parameters(), layouts() and grid only (the type is for checking;
    models/ imports nothing from parallel/ at run time for it)."""
    from safetensors import safe_open

    root = Path(path)
    where = _hf_weight_files(root)
    layouts = pmodel.layouts()
    shape = pmodel.grid.shape
    coords = shape.coords(pmodel.grid.rank)
    handles: dict[Path, Any] = {}
    try:
        for name, param in pmodel.named_parameters():
            hf_name = name if name in where else _hf_name(name, where, fourfold_to_hf_name)
            file = where[hf_name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            piece = handles[file].get_slice(hf_name)
            full_shape = tuple(piece.get_shape())
            layout = layouts[name]
            local = layout.local_shape(full_shape, shape, name)
            if local != tuple(param.shape):
                raise InitFromError(f"model.init_from = {str(root)!r}: {hf_name} has shape "
                                    f"{full_shape}, which does not fit {name} "
                                    f"(local {tuple(param.shape)} on grid {shape})")
            offsets = layout.offsets(full_shape, shape, coords)
            block = piece[tuple(slice(o, o + n) for o, n in zip(offsets, local))]
            param.copy_(block.to(param.dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def _hf_name(name: str, where: dict[str, Path], to_hf: Any) -> str:
    try:
        hf_name = to_hf(name)
    except KeyError:
        hf_name = name
    if hf_name in where:
        return hf_name
    if hf_name == "lm_head.weight" and "model.embed_tokens.weight" in where:
        return "model.embed_tokens.weight"  # tied word embeddings store one matrix
    raise InitFromError(f"the Hugging Face checkpoint has no tensor {hf_name!r} (for {name}); "
                        "is it a Llama-family model of the configured shape?")

# --------------------------------------------------------------------------------------------
# Writing a Hugging Face checkpoint (fourfold convert --to hf)


def save_hf_checkpoint(specs: Sequence[TensorSpec],
                       tensors: Iterable[tuple[TensorSpec, torch.Tensor | None]],
                       cfg: ModelConfig, out_dir: str | Path, bos_token_id: int | None = None,
                       eos_token_id: int | None = None) -> list[Path]:
    """Write a full fourfold model, given as tensor specs and the tensors one at a time (see
    `write_streamed`: the writer never holds the whole model), as a Hugging Face Llama
    checkpoint (config.json, with the special token ids where given, and model.safetensors)
    that `LlamaForCausalLM.from_pretrained(out_dir)` loads; returns the two paths."""
    hf_names = {s.name: fourfold_to_hf_name(s.name) for s in specs
                if not s.name.startswith("rope_")
                and not (cfg.tie_embeddings and s.name == "output.weight")}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / HF_WEIGHTS_FILE
    config = out / HF_CONFIG_FILE
    write_streamed(weights, specs, tensors, {"format": "pt"}, hf_names)
    atomic_write_text(config, json.dumps(config_to_hf(cfg, bos_token_id, eos_token_id),
                                         indent=2) + "\n")
    return [config, weights]
