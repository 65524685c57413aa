"""`fourfold prepare`: text, JSONL and Parquet inputs -> memory-mapped token shards + manifest.json.

A DATA_DIR holds, per split, flat binary files of token ids (uint16, or uint32 for vocabularies
over 65536 ids) with an EOS token after every document, the tokenizer, and manifest.json. Files
are written into a new directory beside DATA_DIR, which takes DATA_DIR's place in one rename when
complete (manifest.json written last inside it): a DATA_DIR is always whole, and preparing over
an old one (`--overwrite`) leaves it whole until the new one is.

What counts as a document: a plain UTF-8 text file (a file over 4 MiB is cut at blank lines into
pieces of about 1 MiB, so a single big file still streams and still yields a validation split),
one line of a .jsonl file (its "text" field), one row of a .parquet file (its "text" column).
With `--format chat` or `--format instruct` a document is one record (data/records.py),
rendered with a chat template (data/chat_template.py); beside its tokens the DATA_DIR keeps one
byte per token that says whether it is trained, `{split}_trained_{index}.bin`, and the template.
A malformed record is skipped with one line naming it and its field. Every split also has a
document index, `{split}_documents.bin`: the int64 offset of each document's first token.

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
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fourfold.data.chat_template import (ChatTemplate, TemplateError, default_template,
                                         template_for)
from fourfold.data.errors import DataError
from fourfold.data.manifest import (DATA_FORMATS, MANIFEST_FILE, SPLITS, TRAIN_ON, Manifest,
                                    ShardInfo, SplitInfo)
from fourfold.data.records import RECORD_FILES, BadRecord, Record, conversation, read_records
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
RECORD_FORMS = ".jsonl, .json or .parquet files of records, or folders of them"
BAD_RECORDS_SHOWN = 20  # lines about skipped records; the rest are counted


@dataclass(frozen=True)
class _Document:
    """One document on its way to the shards."""

    tokens: np.ndarray  # ids, EOS appended for text
    trained: np.ndarray | None  # uint8 per token (chat, instruct); None: every token
    key: str  # the text whose hash chooses the split


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
    data_format: str = "text",
    train_on: str = "assistant",
    report: Callable[[str], None] | None = None,
) -> Manifest:
    """Tokenize `inputs` into DATA_DIR `out_dir`; returns the manifest written there.

    `tokenizer` is a spec (byte, bpe:VOCAB_SIZE, PATH/tokenizer.json); a bpe tokenizer is trained
    on the inputs first. `val_fraction` of the documents (at least one when there are two or more,
    unless it is 0) form the validation split. The progress bar shows only on a terminal.
    A non-empty `out_dir` is refused unless `overwrite`; then the new data is written beside
    it and takes its place in one rename at the end, so that an interrupted prepare leaves the
    old data whole.

    `data_format` (DATA_FORMATS): text, or chat / instruct records rendered with the
    tokenizer's chat template, of which `train_on` (TRAIN_ON) says which tokens are trained.
    `report` gets one line per skipped record (the first BAD_RECORDS_SHOWN; default: stderr).
    """
    if data_format not in DATA_FORMATS:
        raise DataError(f"--format {data_format!r}: expected one of {', '.join(DATA_FORMATS)}")
    if train_on not in TRAIN_ON:
        raise DataError(f"--train-on {train_on!r}: expected one of {', '.join(TRAIN_ON)}")
    records = data_format != "text"
    if not inputs:
        raise DataError(f"no inputs given; expected {RECORD_FORMS if records else INPUT_FORMS}")
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
    sources, skipped = _collect_sources(inputs, exclude=out, records=records)
    show_progress = progress and sys.stderr.isatty()
    tally = _BadRecords(report if report is not None else _to_stderr)
    tok, template = _build_tokenizer(tokenizer, sources, show_progress, data_format)

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as staging:
        dtype = np.dtype(np.uint16) if tok.vocab_size <= 1 << 16 else np.dtype(np.uint32)
        writers = {s: _SplitWriter(staging, s, dtype, shard_tokens, masks=records)
                   for s in SPLITS}
        try:
            if template is None:
                documents = _text_documents_encoded(sources, tok, show_progress)
            else:
                documents = _record_documents(sources, tok, template, data_format, train_on,
                                              tally, show_progress)
            counts = _route_documents(documents, writers, val_fraction)
            if sum(counts.values()) == 0:
                raise _nothing_found(inputs, records, tally)
            splits = {name: writer.commit(counts[name]) for name, writer in writers.items()}
        finally:
            for writer in writers.values():
                writer.close()
        tok.save(staging)
        if template is not None:
            template.save(staging)
        manifest = Manifest(
            tokenizer=tokenizer,
            tokenizer_fingerprint=tokenizer_fingerprint(tok),
            dtype=dtype.name,
            vocab_size=tok.vocab_size,
            eos_id=tok.eos_id,
            splits=splits,
            sources=tuple(str(i) for i in inputs),
            skipped_files=skipped,
            data_format=data_format,
            train_on=train_on if records else "all",
            chat_template=template.source if template is not None else "",
            skipped_records=tally.count,
        )
        manifest.save(staging)
    return manifest


def _nothing_found(inputs: Sequence[str | Path], records: bool, tally: "_BadRecords") -> DataError:
    if not records:
        return DataError(f"no documents found in {_describe(inputs)}: expected {INPUT_FORMS}")
    if tally.count:
        return DataError(f"no usable records in {_describe(inputs)}: all {tally.count} were "
                         f"skipped (the first: {tally.first})")
    return DataError(f"no records found in {_describe(inputs)}: expected {RECORD_FORMS}")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _BadRecords:
    """Reports skipped records, one line each up to BAD_RECORDS_SHOWN, and counts them all."""

    def __init__(self, report: Callable[[str], None]) -> None:
        self.report = report
        self.count = 0
        self.first = ""

    def skip(self, where: str, problem: BadRecord | TemplateError) -> None:
        self.count += 1
        line = f"{where}: skipped: {problem}"
        if self.count == 1:
            self.first = line
        if self.count <= BAD_RECORDS_SHOWN:
            self.report(line)
        elif self.count == BAD_RECORDS_SHOWN + 1:
            self.report("(more skipped records are counted, not shown)")


def prepare_main(inputs: list[str], out: str, tokenizer: str, overwrite: bool = False,
                 data_format: str = "text", train_on: str = "assistant") -> int:
    """`fourfold prepare INPUT... --out DATA_DIR --tokenizer SPEC [--format F] [--train-on T]
    [--overwrite]`: prepare and print a summary."""
    manifest = prepare(inputs, out, tokenizer=tokenizer, overwrite=overwrite,
                       data_format=data_format, train_on=train_on)
    notes = []
    if manifest.skipped_files:
        notes.append(f"skipped {manifest.skipped_files} non-text files")
    if manifest.skipped_records:
        notes.append(f"skipped {manifest.skipped_records:,} bad records")
    skipped = f" ({'; '.join(notes)})" if notes else ""
    what = "documents" if manifest.data_format == "text" else f"{manifest.data_format} records"
    print(f"prepared {manifest.documents:,} {what}{skipped} into {out}")
    for name, split in manifest.splits.items():
        print(f"  {name:<5} {split.tokens:>14,} tokens {split.documents:>10,} documents "
              f"{len(split.shards)} shard(s)")
    print(f"  tokenizer {manifest.tokenizer} (vocab {manifest.vocab_size:,}, "
          f"eos {manifest.eos_id}), dtype {manifest.dtype}")
    if manifest.data_format != "text":
        trained = _trained_fraction(Path(out).expanduser(), manifest)
        print(f"  chat template: {manifest.chat_template}; trained: {manifest.train_on} "
              f"({trained:.0%} of the tokens)")
    return 0


def _trained_fraction(data_dir: Path, manifest: Manifest) -> float:
    ones = total = 0
    for split in manifest.splits.values():
        for shard in split.trained:
            mask = np.fromfile(data_dir / shard.file, dtype=np.uint8)
            ones += int(mask.sum())
            total += len(mask)
    return ones / max(total, 1)


# --------------------------------------------------------------------------------------------
# Inputs


def _describe(inputs: Sequence[str | Path]) -> str:
    names = ", ".join(f"'{i}'" for i in inputs[:3])
    return names + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")


def _collect_sources(inputs: Sequence[str | Path], exclude: Path,
                     records: bool = False) -> tuple[list[_Source], int]:
    """Expand inputs into readable files in a deterministic order; count skipped binaries
    (with `records`: files of records, counting the others skipped)."""
    file_kind = _record_kind if records else _file_kind
    forms = RECORD_FORMS if records else INPUT_FORMS
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
            kind = file_kind(path)
            if kind is None:
                what = "a file of records" if records else "readable as text"
                raise DataError(f"input '{given}': not {what} (expected {forms})")
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
                kind = file_kind(file) if file.is_file() else None
                if kind is None:
                    skipped += 1
                else:
                    add(file, kind)
    return sources, skipped


def _record_kind(path: Path) -> str | None:
    return "records" if path.suffix.lower() in RECORD_FILES else None


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
                hint = _format_hint(record)
                raise DataError(f"{path}:{line_number}: expected a JSON object with a string "
                                f"'text' field{hint}")
            if record["text"]:
                yield record["text"], len(line)


def _format_hint(record: object) -> str:
    """For a text record that looks like a chat or an instruction: the --format it wants."""
    if isinstance(record, dict) and "text" not in record:
        if "messages" in record or "conversations" in record:
            return " (it has 'messages': prepare it with --format chat)"
        if {"prompt", "instruction"} & set(record):
            return " (it looks like an instruction: prepare it with --format instruct)"
    return ""


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


def _build_tokenizer(spec: str, sources: list[_Source], show_progress: bool,
                     data_format: str) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer (a bpe:N one trained on the inputs: on the rendered conversations, for
    records) and, for chat and instruct data, the chat template."""
    vocab_size = parse_bpe_spec(spec)
    if vocab_size is None:
        tok = load_tokenizer(spec)
        return tok, template_for(spec, tok) if data_format != "text" else None
    # a BPE trained here has BPE_EOS as its end-of-text token, as the byte tokenizer's default
    # template writes it
    template = default_template(ByteTokenizer()) if data_format != "text" else None

    def sample() -> Iterator[str]:
        chars = 0
        if template is None:
            texts = _all_documents(sources, show_progress, desc="training bpe")
        else:
            texts = (template.render(messages) for _, messages in
                     _conversations(sources, data_format, None, show_progress, "training bpe"))
        for text in texts:
            yield text
            chars += len(text)
            if chars >= BPE_TRAIN_MAX_CHARS:
                return

    return train_bpe(vocab_size, sample()), template


def _split_hash(text: str) -> float:
    """A uniform number in [0, 1) fixed by the document's text."""
    digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class _ShardWriter:
    """Appends arrays to `{stem}_{index:05d}.bin` files in a directory that becomes the DATA_DIR
    only once complete (see prepare), so each file is written under its own name."""

    def __init__(self, out_dir: Path, stem: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out_dir = out_dir
        self.stem = stem
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
        return f"{self.stem}_{len(self.finished):05d}.bin"

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


class _SplitWriter:
    """One split's files: its token shards, (with `masks`) the trained-token masks in shards
    of the same sizes, and the document index."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 masks: bool) -> None:
        self.out_dir = out_dir
        self.split = split
        self.dtype = dtype
        self.tokens = _ShardWriter(out_dir, split, dtype, shard_tokens)
        self.trained = (_ShardWriter(out_dir, f"{split}_trained", np.dtype(np.uint8),
                                     shard_tokens) if masks else None)
        self.starts = array("q")  # each document's first token in the split
        self.written = 0

    def write(self, document: _Document) -> None:
        self.starts.append(self.written)
        self.tokens.write(document.tokens)
        if self.trained is not None:
            assert document.trained is not None
            self.trained.write(document.trained)
        self.written += len(document.tokens)

    def commit(self, documents: int) -> SplitInfo:
        shards = self.tokens.commit()
        trained = self.trained.commit() if self.trained is not None else []
        name = f"{self.split}_documents.bin"
        raw = np.frombuffer(self.starts, dtype=np.int64).tobytes() if self.starts else b""
        with open(self.out_dir / name, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        index = ShardInfo(name, len(self.starts), hashlib.sha256(raw).hexdigest())
        return SplitInfo(tokens=sum(s.tokens for s in shards), documents=documents,
                         shards=tuple(shards), trained=tuple(trained), document_index=index)

    def close(self) -> None:
        self.tokens.close()
        if self.trained is not None:
            self.trained.close()


def _text_documents_encoded(sources: list[_Source], tok: Tokenizer,
                            show_progress: bool) -> Iterator[_Document]:
    """Every text document through `tok` (in batches), with EOS after it."""
    def encode(texts: list[str]) -> Iterator[_Document]:
        if isinstance(tok, ByteTokenizer):
            encoded: list[np.ndarray] = [tok.encode_bytes(t) for t in texts]
        else:
            encoded = tok.encode_batch(texts)
        for text, ids in zip(texts, encoded, strict=True):
            with_eos = np.empty(len(ids) + 1, dtype=np.int64)
            with_eos[:-1] = ids
            with_eos[-1] = tok.eos_id
            yield _Document(with_eos, None, text)

    pending: list[str] = []
    pending_chars = 0
    for text in _all_documents(sources, show_progress, desc="tokenizing"):
        pending.append(text)
        pending_chars += len(text)
        if len(pending) >= ENCODE_BATCH_DOCS or pending_chars >= ENCODE_BATCH_CHARS:
            yield from encode(pending)
            pending, pending_chars = [], 0
    if pending:
        yield from encode(pending)


def _conversations(sources: list[_Source], data_format: str, tally: _BadRecords | None,
                   show_progress: bool, desc: str) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(where, messages) of every good record; a bad one goes to `tally` (None: left out
    silently, for a first pass that a second one reports)."""
    from tqdm import tqdm

    total = sum(s.path.stat().st_size for s in sources)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr,
              disable=not show_progress, leave=False) as bar:
        for source in sources:
            for record in read_records(source.path):
                bar.update(record.consumed)
                try:
                    if isinstance(record.value, BadRecord):
                        raise record.value
                    yield record.where, conversation(data_format, record.value)
                except BadRecord as bad:
                    if tally is not None:
                        tally.skip(record.where, bad)


def _record_documents(sources: list[_Source], tok: Tokenizer, template: ChatTemplate,
                      data_format: str, train_on: str, tally: _BadRecords,
                      show_progress: bool) -> Iterator[_Document]:
    """Every good record rendered with `template`, tokenized, with its trained mask."""
    for where, messages in _conversations(sources, data_format, tally, show_progress,
                                          "tokenizing"):
        try:
            rendered = template.render_spans(messages)
            ids, trained = template.encode(tok, rendered, train_on)
        except TemplateError as problem:
            tally.skip(where, problem)
            continue
        if len(ids) < 2:  # nothing to predict
            tally.skip(where, BadRecord("", "renders to fewer than 2 tokens"))
            continue
        yield _Document(ids, trained, rendered.text)


def _route_documents(documents: Iterator[_Document], writers: dict[str, _SplitWriter],
                     val_fraction: float) -> dict[str, int]:
    """Write each document into the split its text's hash chooses; documents per split."""
    counts = {"train": 0, "val": 0}
    assigned = {"train": 0, "val": 0}
    # The hash decides each split, but a tiny corpus can hash all documents one way. Writing each
    # split one document late lets us move its last document across at the end, without a second
    # pass over the data and without reordering documents within a split.
    held: dict[str, _Document | None] = {"train": None, "val": None}

    def emit(split: str, document: _Document) -> None:
        writers[split].write(document)
        counts[split] += 1

    for document in documents:
        split = "val" if _split_hash(document.key) < val_fraction else "train"
        assigned[split] += 1
        previous = held[split]
        if previous is not None:
            emit(split, previous)
        held[split] = document

    total = assigned["train"] + assigned["val"]
    if held["train"] is not None:
        rescue_val = assigned["val"] == 0 and total >= 2 and val_fraction > 0
        emit("val" if rescue_val else "train", held["train"])
    if held["val"] is not None:
        rescue_train = assigned["train"] == 0
        emit("train" if rescue_train else "val", held["val"])
    return counts
