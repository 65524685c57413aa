"""Files: writing one so that a reader sees the old version or the new one, never half of
either; and the TOML parser on every Python fourfold supports."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli is the package tomllib was made from, with the same API
    import tomli as tomllib

__all__ = ["atomic_path", "atomic_write_text", "tomllib"]


@contextmanager
def atomic_path(path: Path, durable: bool = False) -> Iterator[Path]:
    """A temporary name beside `path` (same directory, so the rename stays on one file
    system) for the caller to write; when the block ends without an error it replaces `path`
    in one rename, otherwise it is removed. The name carries the process id: ranks on one node
    may write the same file at once. `durable` fsyncs the file before the rename (a crash
    then cannot leave the new name pointing at unwritten data)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str, durable: bool = False) -> None:
    """Write `text` to `path` atomically (see atomic_path)."""
    with atomic_path(path, durable) as tmp:
        tmp.write_text(text)
