"""The built-in corpus: the running interpreter's standard library source, prepared once and cached.

It needs no download, exists wherever Python does, and is real text (about 10 MB of code and
docstrings) — enough for the demo and tests to train something that visibly learns.

builtin:stdlib-docstrings is an instruction set made from the same files: each documented
function (short enough to fit a 512-token row with its answer) becomes "Write the docstring
for this function" and the function without its docstring, answered by the docstring.
It is prepared as instruct data (data/records.py), a held-out split for validation.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import inspect
import json
import os
import re
import shutil
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

from fourfold.config import cache_root
from fourfold.data.errors import DataError
from fourfold.data.manifest import MANIFEST_FILE, Manifest, data_tokenizer_fingerprint
from fourfold.data.prepare import prepare
from fourfold.data.tokenizers import (HF_FILE, META_FILE, check_spec, short_fingerprint,
                                      spec_fingerprint)

# builtin:stdlib-tests, the standard library's own tests, is a second part of the same code
# (for fine-tuning on what pretraining did not see); builtin:stdlib-docstrings the instruction
# set made from builtin:stdlib's functions (for supervised fine-tuning).
BUILTIN_NAMES = ("builtin:stdlib", "builtin:stdlib-tests", "builtin:stdlib-docstrings")
DOCSTRING_INSTRUCTION = "Write the docstring for this function."
# a record's prompt and answer together at most this many characters: with the chat template
# it fits a row of 512 byte tokens, so its answer is trained with the whole function in view
DOCSTRING_RECORD_CHARS = 440
DOCSTRING_MIN_CHARS = 12  # shorter docstrings ("Internal.") teach nothing
DOCSTRING_VAL_FRACTION = 0.05
TEST_DIRS = frozenset({"test", "tests"})
# Tests, GUI and retired packages: large, repetitive, and not what a demo model should imitate.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                          "tkinter", "turtledemo", "__pycache__"})
MAX_CORPUS_BYTES = 16 << 20
AUTO_TOKENIZER = "auto"  # config data.tokenizer: a prepared directory's own, byte for builtin:
BUILTIN_VERSION = 1  # bump when the file selection changes, so old caches are not reused
BUILTIN_VAL_FRACTION = 0.01  # ~6 files of ~600: a validation split of ~100k tokens


def stdlib_files(max_bytes: int = MAX_CORPUS_BYTES, tests: bool = False) -> list[Path]:
    """The standard library's .py files in sorted order, up to `max_bytes` in total (tests:
    those of its test packages instead, which builtin:stdlib leaves out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = SKIPPED_DIRS - TEST_DIRS if tests else SKIPPED_DIRS
    files: list[Path] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(p in skipped or p.startswith(".") for p in parts) or not path.is_file():
            continue
        if tests and (not any(p in TEST_DIRS for p in parts) or not _utf8(path)):
            continue  # (some tests are deliberately in other encodings)
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return files


def _utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def builtin_corpus(tokenizer: str = "byte", cache_dir: Path | None = None,
                   name: str = "builtin:stdlib") -> Path:
    """The DATA_DIR of the built-in corpus `name` (BUILTIN_NAMES) for `tokenizer`, prepared on
    first use.

    Safe when several processes (ranks) call it at once: one prepares under a lock into a
    temporary directory and renames it into place; the others wait and then reuse it.
    """
    check_spec(tokenizer)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tests = name == "builtin:stdlib-tests"
    part = name.removeprefix("builtin:stdlib")  # "", "-tests" or "-docstrings"
    target = root / _cache_key(tokenizer).replace("stdlib-", f"stdlib{part}-", 1)
    if (target / MANIFEST_FILE).is_file():
        return target
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / MANIFEST_FILE).is_file():  # another process finished while we waited
            return target
        files = stdlib_files(tests=tests)
        if not files:
            raise DataError(f"data.path = {name!r}: no standard library "
                            f"{'test ' if tests else ''}sources under "
                            f"{sysconfig.get_paths()['stdlib']}"
                            + (" (some distributions package them apart)" if tests else ""))
        building = root / f".{target.name}.building"
        shutil.rmtree(building, ignore_errors=True)  # left by a process that died mid-way
        if name == "builtin:stdlib-docstrings":
            records = root / f".{target.name}.records.jsonl"
            with open(records, "w", encoding="utf-8") as f:
                for record in docstring_records(files):
                    f.write(json.dumps(record) + "\n")
            prepare([records], building, tokenizer=tokenizer,
                    val_fraction=DOCSTRING_VAL_FRACTION, progress=True, data_format="instruct")
            records.unlink()
        else:
            prepare(files, building, tokenizer=tokenizer, val_fraction=BUILTIN_VAL_FRACTION,
                    progress=True)
        shutil.rmtree(target, ignore_errors=True)  # an incomplete dir without a manifest
        os.rename(building, target)
    return target


def docstring_records(files: list[Path]) -> Iterator[dict[str, str]]:
    """{"prompt", "completion"} for each documented function of `files` (methods too) whose
    code and docstring together are at most DOCSTRING_RECORD_CHARS: the instruction and the
    function without its docstring, answered by the docstring (cleaned as inspect does)."""
    for path in files:
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            docstring = ast.get_docstring(node, clean=True)
            if not docstring or len(docstring) < DOCSTRING_MIN_CHARS or len(node.body) < 2:
                continue
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            doc_node = node.body[0]
            assert doc_node.end_lineno is not None and node.end_lineno is not None
            code = lines[first - 1:doc_node.lineno - 1] + lines[doc_node.end_lineno:
                                                                 node.end_lineno]
            function = textwrap.dedent("".join(code)).strip("\n")
            if len(function) + len(docstring) > DOCSTRING_RECORD_CHARS:
                continue
            yield {"prompt": f"{DOCSTRING_INSTRUCTION}\n\n{function}\n",
                   "completion": inspect.cleandoc(docstring)}


def check_data_path(path: str, tokenizer: str = AUTO_TOKENIZER) -> None:
    """Raise DataError (one line) unless config `data.path` names a built-in corpus or a
    prepared directory, and, for a prepared directory, unless config `data.tokenizer` is
    "auto" or names the tokenizer the directory was made with (same fingerprint; for `bpe:N`,
    the same spec). Reads a few small files and builds nothing: cheap enough to call on every
    rank before the ranks meet, so that they all fail here alike."""
    if path.startswith("builtin:"):
        if path not in BUILTIN_NAMES:
            raise DataError(f"data.path = {path!r}: unknown built-in corpus; expected "
                            f"{', '.join(BUILTIN_NAMES)} or a DATA_DIR made by `fourfold prepare`")
        return
    data_dir = Path(path).expanduser()
    if not (data_dir / MANIFEST_FILE).is_file():
        raise DataError(f"data.path = {path!r}: not a prepared data directory (no "
                        f"{MANIFEST_FILE}); run `fourfold prepare INPUT --out DIR`")
    if tokenizer != AUTO_TOKENIZER:
        _check_data_tokenizer(data_dir, tokenizer)


def _check_data_tokenizer(data_dir: Path, tokenizer: str) -> None:
    """DataError naming both tokenizers unless `tokenizer` is the one data_dir was made with."""
    manifest = Manifest.load(data_dir)
    theirs = data_tokenizer_fingerprint(data_dir)
    ours = spec_fingerprint(tokenizer)
    if ours == theirs or (ours is None and tokenizer == manifest.tokenizer):
        return
    if ours is None:  # bpe:N: a tokenizer trained on the data; what prepare made is another
        named = f"data.tokenizer = {tokenizer!r}"
    else:
        named = f"data.tokenizer = {tokenizer!r} ({short_fingerprint(ours)})"
    raise DataError(f"{named} is not the tokenizer {str(data_dir)!r} was prepared with "
                    f"({manifest.tokenizer!r}, {short_fingerprint(theirs)}); leave "
                    "data.tokenizer at \"auto\" to use the data's own, or prepare the data "
                    "again with it")


def resolve_data_path(path: str, tokenizer: str = AUTO_TOKENIZER) -> Path:
    """The DATA_DIR that config `data.path` names: builtin:stdlib (built on first use, for
    `tokenizer`, byte when "auto") or a prepared directory (whose tokenizer `tokenizer` must
    be, unless "auto": see check_data_path)."""
    check_data_path(path, tokenizer)
    if path.startswith("builtin:"):
        return builtin_corpus("byte" if tokenizer == AUTO_TOKENIZER else tokenizer, name=path)
    return Path(path).expanduser()


def _cache_key(tokenizer: str) -> str:
    """stdlib-v1-py3.11-<tokenizer>: a tokenizer file is keyed by its content, not just its name."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    if tokenizer == "byte" or tokenizer.startswith("bpe:"):
        tok_key = tokenizer.replace(":", "")
    else:
        path = Path(tokenizer).expanduser()
        file = path
        if path.is_dir():  # a HF model directory or another DATA_DIR's tokenizer
            file = path / HF_FILE if (path / HF_FILE).is_file() else path / META_FILE
        digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", file.parent.name) or "tokenizer"
        tok_key = f"{name}-{digest}"
    return f"stdlib-v{BUILTIN_VERSION}-{version}-{tok_key}"
