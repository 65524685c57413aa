"""manifest.json: what a prepared DATA_DIR holds (tokenizer, dtype, splits, shards, checksums)."""

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

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "val")


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
    format_version: int = FORMAT_VERSION

    def split(self, name: str) -> SplitInfo:
        """The named split; DataError naming the splits there are."""
        if name not in self.splits:
            raise DataError(f"split = {name!r}: expected one of {', '.join(self.splits)}")
        return self.splits[name]

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.splits.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "tokenizer": self.tokenizer,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "splits": {
                name: {
                    "tokens": s.tokens,
                    "documents": s.documents,
                    "shards": [{"file": f.file, "tokens": f.tokens, "sha256": f.sha256}
                               for f in s.shards],
                }
                for name, s in self.splits.items()
            },
            "sources": list(self.sources),
            "skipped_files": self.skipped_files,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> Manifest:
        try:
            version = int(data["format_version"])
            if version != FORMAT_VERSION:
                raise DataError(f"{where}: format_version = {version}: this fourfold reads "
                                f"version {FORMAT_VERSION}; prepare the data again")
            splits = {
                name: SplitInfo(
                    tokens=int(s["tokens"]),
                    documents=int(s["documents"]),
                    shards=tuple(ShardInfo(str(f["file"]), int(f["tokens"]), str(f["sha256"]))
                                 for f in s["shards"]),
                )
                for name, s in data["splits"].items()
            }
            return cls(
                tokenizer=str(data["tokenizer"]),
                dtype=str(data["dtype"]),
                vocab_size=int(data["vocab_size"]),
                eos_id=int(data["eos_id"]),
                splits=splits,
                sources=tuple(str(s) for s in data.get("sources", ())),
                skipped_files=int(data.get("skipped_files", 0)),
                tokenizer_fingerprint=str(data.get("tokenizer_fingerprint", "")),
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


def data_tokenizer_fingerprint(data_dir: str | Path) -> str:
    """The fingerprint of the tokenizer a prepared DATA_DIR was made with: its manifest's, or,
    for a directory prepared before manifests recorded one, that of the tokenizer saved in it."""
    fingerprint = Manifest.load(data_dir).tokenizer_fingerprint
    return fingerprint or stored_fingerprint(data_dir)
