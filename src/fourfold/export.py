"""`fourfold convert RUN --to hf OUT`: a run as a Hugging Face folder that
`AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load.

OUT holds config.json (the architecture, RoPE scaling, the tokenizer's special token ids),
model.safetensors, generation_config.json and the run's tokenizer (tokenizer.json,
tokenizer_config.json, special_tokens_map.json; for a run on chat or instruction data the chat
template its data was rendered with, which apply_chat_template then uses). An adapter run exports its merged model, or,
without --merge, the frozen base (model.init_from's files) with the peft adapter in
OUT/adapter. OUT is written beside its place and swapped in when complete
(files.atomic_directory): a failed export leaves OUT as it was, and a non-empty OUT is replaced
only when asked.
"""

from __future__ import annotations

import json
from pathlib import Path

from fourfold.config import Config, ConfigError
from fourfold.data.chat_template import TEMPLATE_FILE, ChatTemplate, data_template
from fourfold.data.tokenizers import (HF_FILE, Tokenizer, spec_fingerprint,
                                      tokenizer_fingerprint, write_hf_tokenizer)
from fourfold.files import (atomic_directory, atomic_write_text, is_empty_directory,
                            recover_directory)
from fourfold.models.adapter import export_base_and_adapter
from fourfold.models.hf import save_hf_checkpoint
from fourfold.train.runs import run_config, run_template_dir, run_tokenizer, trained_tensors

GENERATION_CONFIG = "generation_config.json"


def export_hf(run_dir: str | Path, out_dir: str | Path, *, merge: bool = False,
              overwrite: bool = False) -> list[Path]:
    """Export RUN_DIR as a Hugging Face folder OUT_DIR (see the module docstring); returns
    the files written. ConfigError (one line) for a run that is not one, --merge without an
    adapter, or an OUT_DIR that is not empty (without `overwrite`) or holds the run or its
    base."""
    run, out = Path(run_dir), Path(out_dir).expanduser()
    cfg = run_config(run)
    adapter = cfg.adapter.kind != "none"
    if merge and not adapter:
        raise ConfigError(f"--merge: {run_dir} has no adapter (adapter.kind = 'none'); "
                          "leave --merge out")
    _check_out(out, str(out_dir), run, cfg, overwrite)
    tokenizer = run_tokenizer(run, cfg)
    eos = tokenizer.eos_id
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as staging:
        if adapter and not merge:  # the base and the adapter, apart
            written = export_base_and_adapter(cfg, run, staging, named=out)
            written += _base_tokenizer_files(staging, tokenizer, cfg.model.max_seq_len)
        else:
            # one tensor at a time (a run still training: its newest complete checkpoint,
            # whole); an adapter run's model.safetensors is the merged model
            cfg, specs, tensors = trained_tensors(run)
            written = save_hf_checkpoint(specs, tensors, cfg.model, staging,
                                         bos_token_id=eos, eos_token_id=eos)
            template = _run_chat_template(run, cfg, tokenizer)
            written += write_hf_tokenizer(
                tokenizer, staging, cfg.model.max_seq_len,
                chat_template=template.template if template is not None else None,
                template_tokens=template.special_tokens if template is not None else None)
            written.append(write_generation_config(staging, eos))
        return [out / path.relative_to(staging) for path in dict.fromkeys(written)]


def _run_chat_template(run: Path, cfg: Config, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The chat template a run's chat or instruction data was rendered with (None for text):
    the run's copy, or, for a run without one, its data's."""
    where = run_template_dir(run, cfg)
    if not (where / TEMPLATE_FILE).is_file():
        return None
    return data_template(where, tokenizer)


def write_generation_config(directory: Path, eos_id: int) -> Path:
    """generation_config.json: documents begin after EOS and end with it (the BOS id is EOS,
    see data.tokenizers.write_hf_tokenizer), and padding is EOS as well."""
    path = directory / GENERATION_CONFIG
    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    atomic_write_text(path, json.dumps(ids, indent=2) + "\n")
    return path


def _base_tokenizer_files(out: Path, tokenizer: Tokenizer, max_seq_len: int) -> list[Path]:
    """Next to a copied base: the base's own tokenizer files where they are the run's tokenizer
    (they may say more, a chat template for one), else the run's; and a generation config
    where the base has none."""
    written = []
    if not ((out / HF_FILE).is_file()
            and spec_fingerprint(out / HF_FILE) == tokenizer_fingerprint(tokenizer)):
        written += write_hf_tokenizer(tokenizer, out, max_seq_len)
    if not (out / GENERATION_CONFIG).is_file():
        written.append(write_generation_config(out, tokenizer.eos_id))
    return written


def _check_out(out: Path, given: str, run: Path, cfg: Config, overwrite: bool) -> None:
    recover_directory(out)  # an export killed mid-swap left the old OUT beside it
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT_DIR '{given}' is a file; expected a directory")
    where = out.resolve()
    for what, path in (("the run", str(run)), ("the run's model.init_from", cfg.model.init_from)):
        if path and (where == Path(path).resolve() or where in Path(path).resolve().parents):
            raise ConfigError(f"OUT_DIR '{given}' holds {what} ({path}); choose another "
                              "directory")
    if not overwrite and not is_empty_directory(out):
        raise ConfigError(f"OUT_DIR '{given}' is not empty; pass --overwrite to replace what "
                          "it holds, or choose an empty directory")
