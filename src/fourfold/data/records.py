"""Chat and instruction records as people have them, turned into conversations (lists of
messages), with one line naming the record and the field when one is malformed.

    --format chat      {"messages": [{"role": "user", "content": "..."},
                                     {"role": "assistant", "content": "..."}, ...]}
                       (OpenAI's and Hugging Face's form; a "conversations" field is read the same)
    --format instruct  {"prompt": "...", "completion": "..."}
                       {"instruction": "...", "input": "...", "output": "..."}   (Alpaca)
                       either with an optional "system" string

An instruction becomes a user turn (Alpaca's instruction, then a blank line and its input when
there is one) and the assistant's answer. Records come from .jsonl files (one per line), .json
files (an array of them) and .parquet files (one per row).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fourfold.data.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
RECORD_FILES = (".jsonl", ".json", ".parquet")


class BadRecord(Exception):
    """A record that cannot be used: `field` names what is wrong in it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class Record:
    """One input record: where it is (FILE:LINE, FILE[INDEX] or FILE row N), and its value,
    or the BadRecord that reading it raised."""

    where: str
    value: dict[str, Any] | BadRecord
    consumed: float  # input bytes it stands for (the progress bar's unit)


def conversation(data_format: str, record: dict[str, Any]) -> list[dict[str, str]]:
    """The messages of a chat or instruct record; BadRecord naming the field otherwise."""
    if data_format == "chat":
        return _chat(record)
    if data_format == "instruct":
        return _instruct(record)
    raise ValueError(f"data format {data_format!r} has no records")


def _chat(record: dict[str, Any]) -> list[dict[str, str]]:
    key = "messages" if "messages" in record or "conversations" not in record else "conversations"
    messages = record.get(key)
    if messages is None:
        raise BadRecord("messages", "missing (expected a list of {role, content} objects)")
    if not isinstance(messages, list) or not messages:
        raise BadRecord(key, f"expected a non-empty list of {{role, content}} objects, got "
                        f"{_describe(messages)}")
    out = []
    for i, message in enumerate(messages):
        where = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise BadRecord(where, f"expected an object with role and content, got "
                            f"{_describe(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise BadRecord(f"{where}.role", f"{_describe(role)}: expected one of "
                            f"{', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise BadRecord(f"{where}.content", f"expected a string, got {_describe(content)}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord(key, "no assistant message (nothing to train)")
    return out


def _instruct(record: dict[str, Any]) -> list[dict[str, str]]:
    if "instruction" in record or "output" in record:  # Alpaca
        instruction = _text(record, "instruction", required=True)
        extra = _text(record, "input", required=False)
        user = f"{instruction}\n\n{extra}" if extra else instruction
        answer = _text(record, "output", required=True)
    elif "prompt" in record or "completion" in record:
        user = _text(record, "prompt", required=True)
        answer = _text(record, "completion", required=True)
    else:
        raise BadRecord("prompt", "missing: expected prompt and completion, or instruction "
                        "(with optional input) and output")
    if not answer:
        raise BadRecord("completion" if "completion" in record else "output",
                        "empty (nothing to train)")
    system = _text(record, "system", required=False)
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _text(record: dict[str, Any], name: str, required: bool) -> str:
    value = record.get(name)
    if value is None and not required:
        return ""
    if value is None:
        raise BadRecord(name, "missing")
    if not isinstance(value, str):
        raise BadRecord(name, f"expected a string, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value[:40])
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    if isinstance(value, bool):
        return "a boolean"
    return f"a {type(value).__name__}"


# --------------------------------------------------------------------------------------------
# Reading records from files


def read_records(path: Path) -> Iterator[Record]:
    """The records of a .jsonl, .json or .parquet file, in order. A record that is not a JSON
    object comes as a BadRecord; a file that cannot be read at all is a DataError."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_records(path)
    elif suffix == ".json":
        yield from _json_records(path)
    elif suffix == ".parquet":
        yield from _parquet_records(path)
    else:
        raise DataError(f"input '{path}': chat and instruct data are read from "
                        f"{', '.join(RECORD_FILES)} files")


def _jsonl_records(path: Path) -> Iterator[Record]:
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                value = json.loads(line)
            except ValueError as exc:
                yield Record(where, BadRecord("", f"not valid JSON ({exc})"), len(line))
                continue
            yield Record(where, _object(value), len(line))


def _json_records(path: Path) -> Iterator[Record]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable JSON file ({exc})") from None
    if isinstance(data, dict):  # a single record
        data = [data]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, got {_describe(data)}")
    size = path.stat().st_size / max(len(data), 1)
    for i, value in enumerate(data):
        yield Record(f"{path}[{i}]", _object(value), size)


def _parquet_records(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... on bad files
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    size = path.stat().st_size / max(parquet.metadata.num_rows, 1)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for value in batch.to_pylist():
            yield Record(f"{path} row {row}", _object(value), size)
            row += 1


def _object(value: Any) -> dict[str, Any] | BadRecord:
    if isinstance(value, dict):
        return value
    return BadRecord("", f"expected a JSON object, got {_describe(value)}")


__all__ = ["BadRecord", "RECORD_FILES", "ROLES", "Record", "conversation", "read_records"]
