"""The helpers every layer shares: one copy each."""

from __future__ import annotations

from pathlib import Path

import pytest

from fourfold.errors import UsageError
from fourfold.files import atomic_path, atomic_write_text
from fourfold.intmath import divisors
from fourfold.parsing import ArgumentParser


def test_divisors() -> None:
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(7) == [1, 7]


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    atomic_write_text(path, "new", durable=True)
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]  # no temporary left


def test_parser_has_no_prefix_matching_and_raises_its_usage_error() -> None:
    parser = ArgumentParser(prog="fourfold x")
    parser.add_argument("--nproc", type=int, default=1)
    assert parser.parse_args(["--nproc", "2"]).nproc == 2
    with pytest.raises(UsageError, match=r"unrecognized arguments: --np 2 \(see `fourfold x"):
        parser.parse_args(["--np", "2"])


def test_python_3_10_reads_toml_through_tomli(monkeypatch: pytest.MonkeyPatch) -> None:
    """fourfold.files picks the stdlib's tomllib from 3.11 and tomli (a dependency there) on
    3.10; this test runs on either (the stdlib module is imported only where it exists)."""
    import importlib.util
    import sys
    import types

    import fourfold.files

    this_interpreter = "tomllib" if sys.version_info >= (3, 11) else "tomli"
    assert fourfold.files.tomllib.__name__ == this_interpreter
    assert fourfold.files.tomllib.loads('a = 1\n[b]\nc = "d"\n') == {"a": 1, "b": {"c": "d"}}

    tomli = types.ModuleType("tomli")  # a stand-in: which module is taken, not how it parses
    monkeypatch.setitem(sys.modules, "tomli", tomli)
    monkeypatch.setattr(sys, "version_info", (3, 10, 12, "final", 0))
    spec = importlib.util.spec_from_file_location("files_on_310", fourfold.files.__file__)
    assert spec is not None and spec.loader is not None
    files_on_310 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files_on_310)
    assert files_on_310.tomllib is tomli
