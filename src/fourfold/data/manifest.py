"""manifest.json: what a prepared DATA_DIR holds (tokenizer, dtype, splits, shards, checksums;
for chat and instruction data also which tokens are trained and where documents begin)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fourfold.data.errors import DataError
from fourfold.data.tokenizers import stored_fingerprint
from fourfold.files import atomic_write_text


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in chunks (shards and checkpoint files can be big)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()

# Version 2 added the document index, the trained-token masks and the data format. A version 1
# directory (raw text: every token trained, documents ended by EOS) reads as version 2 without
# them; a reader that knows only version 1 refuses version 2, which it would misread.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "val")
# What `fourfold prepare --format` reads: plain text, chats (`messages`), instructions
# (prompt/completion, or Alpaca's instruction/input/output)
DATA_FORMATS = ("text", "chat", "instruct")
# Which tokens of a chat or instruction are trained (`--train-on`): the assistant's turns (its
# answers and their end-of-turn marks), or every token
TRAIN_ON = ("assistant", "all")


@dataclass(frozen=True)
class ShardInfo:
    """One flat binary file of token ids (dtype from the manifest)."""

    file: str  # relative to the DATA_DIR
    tokens: int
    sha256: str


@dataclass(frozen=True)
class SplitInfo:
    tokens: int  # EOS tokens included
    documents: int
    shards: tuple[ShardInfo, ...]
    # uint8 files beside the token shards, one byte per token (1: trained), with the same
    # token counts; empty when every token is trained (raw text)
    trained: tuple[ShardInfo, ...] = ()
    # int64 offset of each document's first token in the split (its `tokens` counts entries);
    # None in a version 1 directory, whose documents each end with EOS
    document_index: ShardInfo | None = None

    def files(self) -> tuple[ShardInfo, ...]:
        """Every file of the split: token shards, trained masks, the document index."""
        index = (self.document_index,) if self.document_index is not None else ()
        return self.shards + self.trained + index


@dataclass(frozen=True)
class Manifest:
    """The contents of a DATA_DIR; written last by `prepare`, so its presence means complete."""

    tokenizer: str  # the spec the shards were made with
    dtype: str  # uint16 or uint32
    vocab_size: int
    eos_id: int
    splits: dict[str, SplitInfo]
    sources: tuple[str, ...]  # the inputs as given
    skipped_files: int  # non-text files skipped inside input folders
    # which tokenizer made the ids (data.tokenizers.tokenizer_fingerprint); "" in a manifest
    # written before fingerprints were recorded (data_tokenizer_fingerprint computes it)
    tokenizer_fingerprint: str = ""
    data_format: str = "text"  # one of DATA_FORMATS
    train_on: str = "all"  # one of TRAIN_ON ("all" for text)
    chat_template: str = ""  # chat and instruct: "default" or "tokenizer" (data/chat_template.py)
    skipped_records: int = 0  # chat and instruct records left out as malformed
    format_version: int = FORMAT_VERSION

    def split(self, name: str) -> SplitInfo:
        """The named split; DataError naming the splits there are."""
        if name not in self.splits:
            raise DataError(f"split = {name!r}: expected one of {', '.join(self.splits)}")
        return self.splits[name]

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.splits.values())

    @property
    def has_masks(self) -> bool:
        """Whether some tokens are not trained (chat or instruction data)."""
        return any(s.trained for s in self.splits.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "tokenizer": self.tokenizer,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "data_format": self.data_format,
            "train_on": self.train_on,
            "chat_template": self.chat_template,
            "splits": {
                name: {
                    "tokens": s.tokens,
                    "documents": s.documents,
                    "shards": [_file_json(f) for f in s.shards],
                    "trained": [_file_json(f) for f in s.trained],
                    "document_index": (_file_json(s.document_index)
                                       if s.document_index is not None else None),
                }
                for name, s in self.splits.items()
            },
            "sources": list(self.sources),
            "skipped_files": self.skipped_files,
            "skipped_records": self.skipped_records,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> Manifest:
        try:
            version = int(data["format_version"])
            if version not in READABLE_VERSIONS:
                raise DataError(f"{where}: format_version = {version}: this fourfold reads "
                                f"versions {', '.join(map(str, READABLE_VERSIONS))}; prepare "
                                "the data again (or update fourfold)")
            splits = {
                name: SplitInfo(
                    tokens=int(s["tokens"]),
                    documents=int(s["documents"]),
                    shards=tuple(_file_info(f) for f in s["shards"]),
                    trained=tuple(_file_info(f) for f in s.get("trained", ())),
                    document_index=(_file_info(s["document_index"])
                                    if s.get("document_index") is not None else None),
                )
                for name, s in data["splits"].items()
            }
            data_format = str(data.get("data_format", "text"))
            if data_format not in DATA_FORMATS:
                raise DataError(f"{where}: data_format = {data_format!r}: expected one of "
                                f"{', '.join(DATA_FORMATS)}")
            return cls(
                tokenizer=str(data["tokenizer"]),
                dtype=str(data["dtype"]),
                vocab_size=int(data["vocab_size"]),
                eos_id=int(data["eos_id"]),
                splits=splits,
                sources=tuple(str(s) for s in data.get("sources", ())),
                skipped_files=int(data.get("skipped_files", 0)),
                tokenizer_fingerprint=str(data.get("tokenizer_fingerprint", "")),
                data_format=data_format,
                train_on=str(data.get("train_on", "all")),
                chat_template=str(data.get("chat_template", "")),
                skipped_records=int(data.get("skipped_records", 0)),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, DataError):
                raise
            raise DataError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None

    @classmethod
    def load(cls, data_dir: str | Path) -> Manifest:
        """Read DATA_DIR/manifest.json; DataError when it is missing or malformed."""
        path = Path(data_dir) / MANIFEST_FILE
        if not path.is_file():
            raise DataError(f"data path '{data_dir}': not a prepared data directory (no "
                            f"{MANIFEST_FILE}); run `fourfold prepare INPUT --out DIR`")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: unreadable ({exc})") from None
        if not isinstance(data, dict):
            raise DataError(f"{path}: malformed manifest (not a JSON object)")
        return cls.from_json(data, where=str(path))

    def save(self, data_dir: str | Path) -> None:
        """Write manifest.json atomically (temporary name, then rename)."""
        atomic_write_text(Path(data_dir) / MANIFEST_FILE,
                          json.dumps(self.to_json(), indent=2) + "\n", durable=True)


def _file_json(f: ShardInfo) -> dict[str, Any]:
    return {"file": f.file, "tokens": f.tokens, "sha256": f.sha256}


def _file_info(f: dict[str, Any]) -> ShardInfo:
    return ShardInfo(str(f["file"]), int(f["tokens"]), str(f["sha256"]))


def data_tokenizer_fingerprint(data_dir: str | Path) -> str:
    """The fingerprint of the tokenizer a prepared DATA_DIR was made with: its manifest's, or,
    for a directory prepared before manifests recorded one, that of the tokenizer saved in it."""
    fingerprint = Manifest.load(data_dir).tokenizer_fingerprint
    return fingerprint or stored_fingerprint(data_dir)
