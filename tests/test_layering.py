"""Layers keep their word: the parallel engine knows nothing of language models, training or
the launcher (it reads imports, including those inside functions, without importing)."""

from __future__ import annotations

import ast
from pathlib import Path

import fourfold.parallel

PACKAGE = Path(fourfold.parallel.__file__).parent.parent  # src/fourfold (a namespace package)
FORBIDDEN_IN_PARALLEL = ("fourfold.models", "fourfold.train", "fourfold.launch",
                         "fourfold.cli", "fourfold.plan", "fourfold.eval", "fourfold.data")


def imported_modules(source: str, package: str) -> set[str]:
    """Every module a file of `package` imports, at any depth (inside functions too), as
    absolute names (relative imports resolved), with each imported name appended as well."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_parallel_imports_nothing_above_it() -> None:
    files = sorted((PACKAGE / "parallel").glob("*.py"))
    assert len(files) >= 8  # the engine's modules were found
    bad = [f"{path.name} imports {name}" for path in files
           for name in imported_modules(path.read_text(), "fourfold.parallel")
           if any(name == top or name.startswith(top + ".") for top in FORBIDDEN_IN_PARALLEL)]
    assert not bad, "; ".join(bad)


def test_the_check_sees_nested_and_relative_imports() -> None:
    source = ("import torch\n"
              "def build():\n"
              "    from fourfold.train.trainer import train\n"
              "    from ..models import llama\n"
              "    from . import comm\n")
    found = imported_modules(source, "fourfold.parallel")
    assert {"torch", "fourfold.train.trainer", "fourfold.models.llama",
            "fourfold.parallel.comm"} <= found
