"""Files: writing one so that a reader sees the old version or the new one, never half of
either; and the TOML parser on every Python fourfold supports."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli is the package tomllib was made from, with the same API
    import tomli as tomllib

__all__ = ["atomic_directory", "atomic_path", "atomic_write_text", "is_empty_directory",
           "recover_directory", "tomllib"]


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


def is_empty_directory(path: Path) -> bool:
    """Whether `path` is absent or a directory with nothing in it."""
    return not path.exists() or (path.is_dir() and next(path.iterdir(), None) is None)


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """A new directory beside `path` for the caller to fill; when the block ends without an
    error it takes `path`'s place, and what was there (a directory) is deleted after; on an
    error it is removed and `path` is left as it was. The swap is one step where the system
    offers one (Linux's renameat2 exchange), else two renames with the old directory moved
    back should the second fail; a process killed between them leaves the old directory whole
    under `.NAME.old-PID`, which the next call (or recover_directory) puts back."""
    path = Path(path)
    recover_directory(path)
    new = path.with_name(f".{path.name}.new-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    try:
        yield new
        if not path.exists():
            os.rename(new, path)
        elif _exchange(new, path):
            shutil.rmtree(new)  # the old directory, now under the new one's name
        else:
            os.rename(path, old)
            try:
                os.rename(new, path)
            except BaseException:
                os.rename(old, path)
                raise
            shutil.rmtree(old)
        _sync_directory(path.parent)
    finally:
        shutil.rmtree(new, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where the
    system or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def recover_directory(path: Path) -> None:
    """Clear what an atomic_directory of an ended process left beside `path`: a `.NAME.old-PID`
    goes back to `path` when nothing took its place (the process died between the two renames),
    else it is deleted, as is a `.NAME.new-PID`. Call it before looking at what `path` holds."""
    for leftover in sorted(path.parent.glob(f".{path.name}.*-*")):
        kind, _, pid = leftover.name[len(path.name) + 2:].partition("-")
        if kind not in ("new", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not path.exists():
            os.rename(leftover, path)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _sync_directory(directory: Path) -> None:
    """fsync a directory, so that renames in it survive a crash (where the system allows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
