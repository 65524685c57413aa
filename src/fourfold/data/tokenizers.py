"""Tokenizers: raw UTF-8 bytes, byte-level BPE trained on the user's corpus, or a local HF file.

A tokenizer is named by a spec string:
  byte                  UTF-8 bytes 0..255 plus EOS = 256 (vocab 257); needs no training
  bpe:VOCAB_SIZE        byte-level BPE trained on the corpus by `fourfold prepare`
  PATH/tokenizer.json   a Hugging Face tokenizer file, as shipped with HF models

A prepared DATA_DIR stores its tokenizer (`save`), so `load_tokenizer(DATA_DIR)` gives back exactly
the tokenizer its shards were made with, trained BPE included.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from fourfold.data.errors import DataError
from fourfold.files import atomic_path, atomic_write_text

ALLOWED_SPECS = "byte, bpe:VOCAB_SIZE (257..1000000) or PATH/tokenizer.json"
META_FILE = "fourfold_tokenizer.json"  # what kind of tokenizer a directory holds
HF_FILE = "tokenizer.json"
BPE_EOS = "<|endoftext|>"
# Tried in order when tokenizer_config.json does not name the EOS token.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>",
                  "[SEP]")
BYTE_FINGERPRINT = "byte"
BPE_MIN_VOCAB = 257  # 256 byte symbols + EOS
BPE_MAX_VOCAB = 1_000_000

TokenIds = Sequence[int] | np.ndarray


class Tokenizer(ABC):
    """Text <-> token ids. `encode` never adds EOS; the data pipeline appends it per document."""

    spec: str
    vocab_size: int
    eos_id: int

    @abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as a 1-D int64 array (no EOS appended)."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` over many texts; subclasses may do it in parallel."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: TokenIds) -> str:
        """Text of `ids`; EOS and ids outside the vocabulary are dropped, bad bytes replaced."""

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write the tokenizer into `directory` so that `load_tokenizer(directory)` restores it."""

    def _write_meta(self, directory: Path, kind: str) -> None:
        meta = {"kind": kind, "spec": self.spec, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id}
        atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2) + "\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, EOS = 256."""

    spec = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        # frombuffer: a big corpus is encoded without a Python-level loop per byte.
        raw = text.encode("utf-8", errors="replace")
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)

    def encode_bytes(self, text: str) -> np.ndarray:
        """The uint8 view the data pipeline writes without widening to int64 first."""
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)

    def decode(self, ids: TokenIds) -> str:
        arr = _as_int_array(ids)
        arr = arr[(arr >= 0) & (arr < 256)]
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._write_meta(directory, "byte")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer`: a trained byte-level BPE or a model's tokenizer.json. One read
    from a file (`source`) is saved as that file's bytes, so that a copy keeps its fingerprint
    (see tokenizer_fingerprint)."""

    def __init__(self, hf_tokenizer, spec: str, eos_id: int,  # noqa: ANN001 (HF type)
                 source: Path | None = None) -> None:
        self.hf = hf_tokenizer
        self.spec = spec
        self.eos_id = eos_id
        self.source = source
        self.vocab_size = int(hf_tokenizer.get_vocab_size(with_added_tokens=True))

    def file_bytes(self) -> bytes:
        """The tokenizer.json this tokenizer is saved as: its source file's bytes, or the
        tokenizers library's serialization of one trained here."""
        if self.source is not None:
            return self.source.read_bytes()
        return self.hf.to_str(pretty=True).encode("utf-8")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self.hf.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: TokenIds) -> str:
        arr = _as_int_array(ids)
        arr = arr[(arr >= 0) & (arr < self.vocab_size)]
        return self.hf.decode(arr.tolist(), skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / HF_FILE) as tmp:
            tmp.write_bytes(self.file_bytes())
        self._write_meta(directory, "hf")


# --------------------------------------------------------------------------------------------
# Specs


def parse_bpe_spec(spec: str) -> int | None:
    """The vocabulary size of a `bpe:N` spec, None for other specs; DataError if N is bad."""
    if not spec.startswith("bpe:"):
        return None
    value = spec[4:]
    if not re.fullmatch(r"[0-9]+", value) or not BPE_MIN_VOCAB <= int(value) <= BPE_MAX_VOCAB:
        raise DataError(f"tokenizer = {spec!r}: expected {ALLOWED_SPECS}")
    return int(value)


def check_spec(spec: str) -> None:
    """Raise DataError unless `spec` is a usable tokenizer spec (before any slow work starts)."""
    if spec == "byte" or parse_bpe_spec(spec) is not None:
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        if not ((path / META_FILE).is_file() or (path / HF_FILE).is_file()):
            raise DataError(f"tokenizer = {spec!r}: directory holds neither {HF_FILE} nor "
                            f"{META_FILE} (expected {ALLOWED_SPECS})")
        return
    if path.is_file():
        return
    if spec.endswith(".json") or "/" in spec or os.sep in spec:
        raise DataError(f"tokenizer = {spec!r}: file not found (expected {ALLOWED_SPECS})")
    raise DataError(f"tokenizer = {spec!r}: expected {ALLOWED_SPECS}")


def load_tokenizer(spec_or_data_dir: str | Path) -> Tokenizer:
    """The tokenizer named by a spec string, or the one stored in a prepared DATA_DIR.

    A directory may be a DATA_DIR (its stored tokenizer) or a HF model directory (its
    tokenizer.json). A `bpe:N` spec is only loadable from the DATA_DIR it was trained for.
    """
    spec = str(spec_or_data_dir)
    check_spec(spec)
    if spec == "byte":
        return ByteTokenizer()
    if parse_bpe_spec(spec) is not None:
        raise DataError(f"tokenizer = {spec!r}: a BPE tokenizer is trained by `fourfold prepare "
                        "--tokenizer bpe:N`; load it from that DATA_DIR")
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / META_FILE).is_file():
            return _load_saved(path)
        return _load_hf_file(path / HF_FILE, spec=spec)
    return _load_hf_file(path, spec=spec)


# --------------------------------------------------------------------------------------------
# Fingerprints: which tokenizer made a token id, whatever the tokenizer is called


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """"byte" for the byte tokenizer, else "sha256:" and the hash of the tokenizer.json it is
    saved as (the very file it was read from): equal fingerprints encode text alike."""
    if isinstance(tokenizer, ByteTokenizer):
        return BYTE_FINGERPRINT
    if isinstance(tokenizer, HFTokenizer):
        return _hf_file_fingerprint(tokenizer.file_bytes())
    raise TypeError(f"no fingerprint for {type(tokenizer).__name__}")


def spec_fingerprint(spec: str | Path) -> str | None:
    """The fingerprint of the tokenizer a spec names (byte, PATH/tokenizer.json, or a
    directory holding one or a saved fourfold tokenizer), read without loading it; None for a
    `bpe:N` spec, which names no tokenizer until `prepare` trains one."""
    spec = str(spec)
    check_spec(spec)
    if spec == "byte":
        return BYTE_FINGERPRINT
    if parse_bpe_spec(spec) is not None:
        return None
    path = Path(spec).expanduser()
    return stored_fingerprint(path) if path.is_dir() else _hf_file_fingerprint(path.read_bytes())


def stored_fingerprint(directory: str | Path) -> str:
    """The fingerprint of the tokenizer saved in `directory` (a DATA_DIR, a HF model folder)."""
    directory = Path(directory)
    if (directory / META_FILE).is_file():
        try:
            kind = json.loads((directory / META_FILE).read_text())["kind"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{directory / META_FILE}: unreadable tokenizer description "
                            f"({exc})") from None
        if kind == "byte":
            return BYTE_FINGERPRINT
    if not (directory / HF_FILE).is_file():
        raise DataError(f"{directory}: no tokenizer there (neither {HF_FILE} nor {META_FILE})")
    return _hf_file_fingerprint((directory / HF_FILE).read_bytes())


def _hf_file_fingerprint(data: bytes) -> str:
    """The fingerprint of a tokenizer.json's bytes: "byte" for the byte tokenizer as fourfold
    writes it for transformers (an HF export of a byte-level run), which encodes text to the
    byte tokenizer's ids; else the file's hash."""
    if data == byte_level_hf_file():
        return BYTE_FINGERPRINT
    return _sha256(data)


def short_fingerprint(fingerprint: str) -> str:
    """A fingerprint shortened for a message ("byte", or "sha256:" and 12 hex digits)."""
    return fingerprint[:len("sha256:") + 12]


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def train_bpe(vocab_size: int, texts: Iterable[str]) -> HFTokenizer:
    """Train a byte-level BPE (vocab <= vocab_size, EOS included) on `texts`."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not BPE_MIN_VOCAB <= vocab_size <= BPE_MAX_VOCAB:
        raise DataError(f"tokenizer = 'bpe:{vocab_size}': expected {ALLOWED_SPECS}")
    hf = HFTok(models.BPE())
    # ByteLevel on both sides: every string maps to byte symbols, so decode(encode(s)) == s.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    eos_id = hf.token_to_id(BPE_EOS)
    return HFTokenizer(hf, spec=f"bpe:{vocab_size}", eos_id=int(eos_id))


# --------------------------------------------------------------------------------------------
# A tokenizer as the files transformers' AutoTokenizer reads (fourfold convert --to hf)

HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS = "special_tokens_map.json"


def byte_level_hf_tokenizer():  # noqa: ANN201 (a tokenizers.Tokenizer)
    """A `tokenizers.Tokenizer` that encodes as ByteTokenizer does: byte b of the UTF-8 text is
    id b, EOS (<|endoftext|>) is 256. Byte-level pre-tokenization maps each byte to one
    printable character, and a BPE without merges maps each character to its byte's id."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    hf = HFTok(models.BPE(vocab={char: byte for byte, char in _byte_characters().items()},
                          merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(BPE_EOS, special=True)])
    return hf


def _byte_characters() -> dict[int, str]:
    """Byte -> the character byte-level tokenizers write it as (GPT-2's table: printable
    Latin-1 bytes stand for themselves, the others for characters from U+0100 on)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def byte_level_hf_file() -> bytes:
    """The tokenizer.json fourfold writes for the byte tokenizer (byte_level_hf_tokenizer)."""
    return byte_level_hf_tokenizer().to_str(pretty=True).encode("utf-8")


def write_hf_tokenizer(tokenizer: Tokenizer, directory: str | Path, model_max_length: int,
                       chat_template: str | None = None,
                       template_tokens: dict[str, str] | None = None) -> list[Path]:
    """Write `tokenizer` as tokenizer.json, tokenizer_config.json and special_tokens_map.json,
    which `transformers.AutoTokenizer.from_pretrained(directory)` loads to encode text to the
    same ids (the byte tokenizer as byte_level_hf_tokenizer). fourfold's documents are
    separated by EOS and nothing else, so EOS also serves as the BOS token (as in GPT-2), and
    nothing is added around an encoded text. A `chat_template` (the one the run's chat data
    was rendered with) goes into tokenizer_config.json with the special tokens it was
    rendered with (`template_tokens`), so that apply_chat_template gives the same ids.
    Returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, ByteTokenizer):
        data = byte_level_hf_file()
        eos = BPE_EOS
    elif isinstance(tokenizer, HFTokenizer):
        data = tokenizer.file_bytes()
        eos = tokenizer.hf.id_to_token(tokenizer.eos_id)
    else:
        raise TypeError(f"cannot write {type(tokenizer).__name__} for transformers")
    special = {"bos_token": eos, "eos_token": eos, **(template_tokens or {})}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    files = {HF_FILE: data, HF_TOKENIZER_CONFIG: _json_bytes(config),
             HF_SPECIAL_TOKENS: _json_bytes(special)}
    for name, content in files.items():
        with atomic_path(directory / name) as tmp:
            tmp.write_bytes(content)
    return [directory / name for name in files]


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


# --------------------------------------------------------------------------------------------
# Helpers


def _load_saved(directory: Path) -> Tokenizer:
    try:
        meta = json.loads((directory / META_FILE).read_text())
        kind, spec, eos_id = meta["kind"], meta["spec"], int(meta["eos_id"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{directory / META_FILE}: unreadable tokenizer description "
                        f"({exc})") from None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        return _load_hf_file(directory / HF_FILE, spec=spec, eos_id=eos_id)
    raise DataError(f"{directory / META_FILE}: kind = {kind!r}: expected 'byte' or 'hf'")


def _load_hf_file(path: Path, spec: str, eos_id: int | None = None) -> HFTokenizer:
    from tokenizers import Tokenizer as HFTok

    try:
        hf = HFTok.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception on malformed files
        raise DataError(f"tokenizer = {spec!r}: cannot read {path} ({exc})") from None
    if eos_id is None:
        eos_id = _find_eos(hf, path)
    return HFTokenizer(hf, spec=spec, eos_id=eos_id, source=path)


def _find_eos(hf, path: Path) -> int:  # noqa: ANN001 (HF type)
    names: list[str] = []
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except ValueError:
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    names.extend(EOS_CANDIDATES)
    for name in names:
        token_id = hf.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    raise DataError(f"tokenizer = '{path}': no end-of-text token found (looked for "
                    f"{', '.join(EOS_CANDIDATES)} and eos_token in tokenizer_config.json)")


def _as_int_array(ids: TokenIds) -> np.ndarray:
    if hasattr(ids, "detach"):  # a torch tensor, without importing torch here
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64).reshape(-1)

