"""`fourfold prepare`: text, JSONL and Parquet inputs -> memory-mapped token shards + manifest.json.

A DATA_DIR holds, per split, flat binary files of token ids (uint16, or uint32 for vocabularies
over 65536 ids) with an EOS token after every document, the tokenizer, and manifest.json. Files
are written into a new directory beside DATA_DIR, which takes DATA_DIR's place in one rename when
complete (manifest.json written last inside it): a DATA_DIR is always whole, and preparing over
an old one (`--overwrite`) leaves it whole until the new one is.

What counts as a document: a plain UTF-8 text file (a file over 4 MiB is cut at blank lines into
pieces of about 1 MiB, so a single big file still streams and still yields a validation split),
one line of a .jsonl file (its "text" field), one row of a .parquet file (its "text" column).

The validation split is chosen by a hash of each document's text: deterministic, independent of
input order and tokenizer, and exact duplicates always land in the same split. When the hash puts
all of two or more documents into one split, the last of them moves to the other split.
Documents keep their input order within each split.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fourfold.data.errors import DataError
from fourfold.data.manifest import MANIFEST_FILE, SPLITS, Manifest, ShardInfo, SplitInfo
from fourfold.data.tokenizers import (ByteTokenizer, Tokenizer, check_spec, load_tokenizer,
                                      parse_bpe_spec, tokenizer_fingerprint, train_bpe)
from fourfold.files import atomic_directory, is_empty_directory, recover_directory

DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB per uint16 shard: few files, each cheap to rehash
BIG_TEXT_BYTES = 4 << 20
TEXT_PIECE_BYTES = 1 << 20
BPE_TRAIN_MAX_CHARS = 256 << 20  # BPE merges settle long before this; bounds training time
ENCODE_BATCH_DOCS = 512
ENCODE_BATCH_CHARS = 16 << 20
SNIFF_BYTES = 8192
INPUT_FORMS = ("UTF-8 text files, folders of them, .jsonl files with a 'text' field "
               "or .parquet files with a 'text' column")


@dataclass(frozen=True)
class _Source:
    path: Path
    kind: str  # text | jsonl | parquet


# --------------------------------------------------------------------------------------------
# Public entry points


def prepare(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.005,
    progress: bool = True,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
) -> Manifest:
    """Tokenize `inputs` into DATA_DIR `out_dir`; returns the manifest written there.

    `tokenizer` is a spec (byte, bpe:VOCAB_SIZE, PATH/tokenizer.json); a bpe tokenizer is trained
    on the inputs first. `val_fraction` of the documents (at least one when there are two or more,
    unless it is 0) form the validation split. The progress bar shows only on a terminal.
    A non-empty `out_dir` is refused unless `overwrite`; then the new data is written beside
    it and takes its place in one rename at the end, so that an interrupted prepare leaves the
    old data whole.
    """
    if not inputs:
        raise DataError(f"no inputs given; expected {INPUT_FORMS}")
    if not 0.0 <= val_fraction <= 0.5:
        raise DataError(f"val_fraction = {val_fraction}: expected a number in [0, 0.5]")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens = {shard_tokens}: expected a positive integer")
    check_spec(tokenizer)
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"--out '{out_dir}': exists and is not a directory")
    recover_directory(out)  # a prepare killed mid-swap left the old data beside it
    if not overwrite and not is_empty_directory(out):
        what = "a prepared data directory" if (out / MANIFEST_FILE).is_file() else "files"
        raise DataError(f"--out '{out_dir}' already holds {what}; pass --overwrite to replace "
                        "it, or choose an empty directory")
    sources, skipped = _collect_sources(inputs, exclude=out)
    show_progress = progress and sys.stderr.isatty()
    tok = _build_tokenizer(tokenizer, sources, show_progress)

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as staging:
        dtype = np.dtype(np.uint16) if tok.vocab_size <= 1 << 16 else np.dtype(np.uint32)
        writers = {s: _ShardWriter(staging, s, dtype, shard_tokens) for s in SPLITS}
        try:
            counts = _tokenize_into(sources, tok, writers, val_fraction, show_progress)
            if sum(counts.values()) == 0:
                raise DataError(f"no documents found in {_describe(inputs)}: expected "
                                f"{INPUT_FORMS}")
            splits = {}
            for name, writer in writers.items():
                shards = writer.commit()
                splits[name] = SplitInfo(tokens=sum(s.tokens for s in shards),
                                         documents=counts[name], shards=tuple(shards))
        finally:
            for writer in writers.values():
                writer.close()
        tok.save(staging)
        manifest = Manifest(
            tokenizer=tokenizer,
            tokenizer_fingerprint=tokenizer_fingerprint(tok),
            dtype=dtype.name,
            vocab_size=tok.vocab_size,
            eos_id=tok.eos_id,
            splits=splits,
            sources=tuple(str(i) for i in inputs),
            skipped_files=skipped,
        )
        manifest.save(staging)
    return manifest


def prepare_main(inputs: list[str], out: str, tokenizer: str, overwrite: bool = False) -> int:
    """`fourfold prepare INPUT... --out DATA_DIR --tokenizer SPEC [--overwrite]`: prepare and
    print a summary."""
    manifest = prepare(inputs, out, tokenizer=tokenizer, overwrite=overwrite)
    skipped = (f" (skipped {manifest.skipped_files} non-text files)"
               if manifest.skipped_files else "")
    print(f"prepared {manifest.documents:,} documents{skipped} into {out}")
    for name, split in manifest.splits.items():
        print(f"  {name:<5} {split.tokens:>14,} tokens {split.documents:>10,} documents "
              f"{len(split.shards)} shard(s)")
    print(f"  tokenizer {manifest.tokenizer} (vocab {manifest.vocab_size:,}, "
          f"eos {manifest.eos_id}), dtype {manifest.dtype}")
    return 0


# --------------------------------------------------------------------------------------------
# Inputs


def _describe(inputs: Sequence[str | Path]) -> str:
    names = ", ".join(f"'{i}'" for i in inputs[:3])
    return names + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")


def _collect_sources(inputs: Sequence[str | Path], exclude: Path) -> tuple[list[_Source], int]:
    """Expand inputs into readable files in a deterministic order; count skipped binaries."""
    sources: list[_Source] = []
    seen: set[Path] = set()
    skipped = 0
    exclude_resolved = exclude.resolve()

    def add(path: Path, kind: str) -> None:
        resolved = path.resolve()
        if resolved not in seen:
            seen.add(resolved)
            sources.append(_Source(path, kind))

    for given in inputs:
        path = Path(given).expanduser()
        if not path.exists():
            raise DataError(f"input '{given}': no such file or directory")
        if path.is_file():
            kind = _file_kind(path)
            if kind is None:
                raise DataError(f"input '{given}': not readable as text (expected {INPUT_FORMS})")
            add(path, kind)
            continue
        for root, dirs, files in os.walk(path):
            root_path = Path(root)
            # Hidden folders (.git, .venv), bytecode caches and our own output are never corpus.
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                             and (root_path / d).resolve() != exclude_resolved)
            for name in sorted(files):
                if name.startswith("."):
                    continue
                file = root_path / name
                kind = _file_kind(file) if file.is_file() else None
                if kind is None:
                    skipped += 1
                else:
                    add(file, kind)
    return sources, skipped


def _file_kind(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return None
    if b"\0" in head:
        return None
    try:  # incremental: a multi-byte character cut at the end of the sniffed block is fine
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return None
    return "text"


def _documents(source: _Source) -> Iterator[tuple[str, float]]:
    """(text, input bytes consumed) per document of one source; empty documents left out."""
    if source.kind == "jsonl":
        yield from _jsonl_documents(source.path)
    elif source.kind == "parquet":
        yield from _parquet_documents(source.path)
    else:
        yield from _text_documents(source.path)


def _text_documents(path: Path) -> Iterator[tuple[str, float]]:
    size = path.stat().st_size
    if size <= BIG_TEXT_BYTES:
        text = path.read_bytes().decode("utf-8", errors="replace")
        if text:
            yield text, size
        return
    piece: list[bytes] = []
    piece_bytes = 0
    with open(path, "rb") as f:
        for line in f:
            piece.append(line)
            piece_bytes += len(line)
            at_paragraph_end = piece_bytes >= TEXT_PIECE_BYTES and not line.strip()
            if at_paragraph_end or piece_bytes >= BIG_TEXT_BYTES:
                yield b"".join(piece).decode("utf-8", errors="replace"), piece_bytes
                piece, piece_bytes = [], 0
    if piece:
        yield b"".join(piece).decode("utf-8", errors="replace"), piece_bytes


def _jsonl_documents(path: Path) -> Iterator[tuple[str, float]]:
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{line_number}: not valid JSON ({exc})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{path}:{line_number}: expected a JSON object with a string "
                                "'text' field")
            if record["text"]:
                yield record["text"], len(line)


def _parquet_documents(path: Path) -> Iterator[tuple[str, float]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... on bad files
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    names = parquet.schema_arrow.names
    if "text" not in names:
        raise DataError(f"{path}: no 'text' column (columns: {', '.join(names)})")
    rows = max(parquet.metadata.num_rows, 1)
    bytes_per_row = path.stat().st_size / rows
    for batch in parquet.iter_batches(batch_size=1024, columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise DataError(f"{path}: column 'text' holds {type(text).__name__}, "
                                "expected strings")
            if text:
                yield text, bytes_per_row


def _all_documents(sources: list[_Source], show_progress: bool, desc: str) -> Iterator[str]:
    from tqdm import tqdm

    total = sum(s.path.stat().st_size for s in sources)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr,
              disable=not show_progress, leave=False) as bar:
        for source in sources:
            for text, consumed in _documents(source):
                bar.update(consumed)
                yield text


# --------------------------------------------------------------------------------------------
# Tokenizing and writing


def _build_tokenizer(spec: str, sources: list[_Source], show_progress: bool) -> Tokenizer:
    vocab_size = parse_bpe_spec(spec)
    if vocab_size is None:
        return load_tokenizer(spec)

    def sample() -> Iterator[str]:
        chars = 0
        for text in _all_documents(sources, show_progress, desc="training bpe"):
            yield text
            chars += len(text)
            if chars >= BPE_TRAIN_MAX_CHARS:
                return

    return train_bpe(vocab_size, sample())


def _split_hash(text: str) -> float:
    """A uniform number in [0, 1) fixed by the document's text."""
    digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class _ShardWriter:
    """Appends token arrays to `{split}_{index:05d}.bin` files in a directory that becomes the
    DATA_DIR only once complete (see prepare), so each file is written under its own name."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out_dir = out_dir
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.finished: list[ShardInfo] = []
        self._file = None
        self._hash = hashlib.sha256()
        self._tokens = 0

    def write(self, tokens: np.ndarray) -> None:
        buf = tokens.astype(self.dtype, copy=False)
        while len(buf):
            if self._file is None:
                self._file = open(self.out_dir / self._name(), "wb")
                self._hash = hashlib.sha256()
                self._tokens = 0
            take = min(len(buf), self.shard_tokens - self._tokens)
            raw = buf[:take].tobytes()
            self._file.write(raw)
            self._hash.update(raw)
            self._tokens += take
            buf = buf[take:]
            if self._tokens == self.shard_tokens:
                self._finish_shard()

    def _name(self) -> str:
        return f"{self.split}_{len(self.finished):05d}.bin"

    def _finish_shard(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.finished.append(ShardInfo(self._name(), self._tokens, self._hash.hexdigest()))
        self._file = None

    def commit(self) -> list[ShardInfo]:
        """Close the last shard; every shard's name, tokens and checksum."""
        if self._file is not None:
            self._finish_shard()
        return list(self.finished)

    def close(self) -> None:
        """Close an unfinished shard (after an error)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _tokenize_into(sources: list[_Source], tok: Tokenizer, writers: dict[str, _ShardWriter],
                   val_fraction: float, show_progress: bool) -> dict[str, int]:
    """Stream every document through `tok` into the split writers; documents per split."""
    counts = {"train": 0, "val": 0}
    assigned = {"train": 0, "val": 0}
    # The hash decides each split, but a tiny corpus can hash all documents one way. Writing each
    # split one document late lets us move its last document across at the end, without a second
    # pass over the data and without reordering documents within a split.
    held: dict[str, np.ndarray | None] = {"train": None, "val": None}

    def emit(split: str, tokens: np.ndarray) -> None:
        writers[split].write(tokens)
        counts[split] += 1

    def route(u: float, tokens: np.ndarray) -> None:
        split = "val" if u < val_fraction else "train"
        assigned[split] += 1
        previous = held[split]
        if previous is not None:
            emit(split, previous)
        held[split] = tokens

    def flush(texts: list[str]) -> None:
        if isinstance(tok, ByteTokenizer):
            encoded: list[np.ndarray] = [tok.encode_bytes(t) for t in texts]
        else:
            encoded = tok.encode_batch(texts)
        for text, ids in zip(texts, encoded, strict=True):
            with_eos = np.empty(len(ids) + 1, dtype=writers["train"].dtype)
            with_eos[:-1] = ids
            with_eos[-1] = tok.eos_id
            route(_split_hash(text), with_eos)

    pending: list[str] = []
    pending_chars = 0
    for text in _all_documents(sources, show_progress, desc="tokenizing"):
        pending.append(text)
        pending_chars += len(text)
        if len(pending) >= ENCODE_BATCH_DOCS or pending_chars >= ENCODE_BATCH_CHARS:
            flush(pending)
            pending, pending_chars = [], 0
    if pending:
        flush(pending)

    total = assigned["train"] + assigned["val"]
    if held["train"] is not None:
        rescue_val = assigned["val"] == 0 and total >= 2 and val_fraction > 0
        emit("val" if rescue_val else "train", held["train"])
    if held["val"] is not None:
        rescue_train = assigned["train"] == 0
        emit("train" if rescue_train else "val", held["val"])
    return counts
