"""Layers keep their word: the parallel engine knows nothing of language models, training or
the launcher; the planner never imports the trainer; what both share sits below both (it reads
imports, including those inside functions, without importing)."""

from __future__ import annotations

import ast
from pathlib import Path

import fourfold.parallel

PACKAGE = Path(fourfold.parallel.__file__).parent.parent  # src/fourfold (a namespace package)
FORBIDDEN_IN_PARALLEL = ("fourfold.models", "fourfold.train", "fourfold.launch",
                         "fourfold.cli", "fourfold.plan", "fourfold.eval", "fourfold.data")
# the planner reads configs, models and grids; it predicts the trainer, never runs it
FORBIDDEN_IN_PLAN = ("fourfold.train", "fourfold.launch", "fourfold.cli", "fourfold.eval")
# modules the trainer and the planner both import (a fact defined once, below both)
SHARED_BELOW_PLAN_AND_TRAIN = ("noise.py",)


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


def forbidden_imports(files: list[Path], package: str, forbidden: tuple[str, ...]) -> list[str]:
    """'FILE imports NAME' for each import of `files` (modules of `package`) from `forbidden`."""
    return [f"{path.name} imports {name}" for path in files
            for name in imported_modules(path.read_text(), package)
            if any(name == top or name.startswith(top + ".") for top in forbidden)]


def test_parallel_imports_nothing_above_it() -> None:
    files = sorted((PACKAGE / "parallel").glob("*.py"))
    assert len(files) >= 8  # the engine's modules were found
    bad = forbidden_imports(files, "fourfold.parallel", FORBIDDEN_IN_PARALLEL)
    assert not bad, "; ".join(bad)


def test_the_planner_never_imports_the_trainer() -> None:
    files = sorted((PACKAGE / "plan").glob("*.py"))
    assert len(files) >= 10  # the planner's modules were found
    bad = forbidden_imports(files, "fourfold.plan", FORBIDDEN_IN_PLAN)
    assert not bad, "; ".join(bad)


def test_what_plan_and_train_share_sits_below_both() -> None:
    files = [PACKAGE / name for name in SHARED_BELOW_PLAN_AND_TRAIN]
    bad = forbidden_imports(files, "fourfold", ("fourfold.train", "fourfold.plan"))
    assert not bad, "; ".join(bad)
    uses = {layer: [p.name for p in sorted((PACKAGE / layer).rglob("*.py"))
                    if "fourfold.noise" in imported_modules(p.read_text(), f"fourfold.{layer}")]
            for layer in ("train", "plan")}
    assert uses["train"] and uses["plan"], uses  # both layers read the one definition


def test_the_check_sees_nested_and_relative_imports() -> None:
    source = ("import torch\n"
              "def build():\n"
              "    from fourfold.train.trainer import train\n"
              "    from ..models import llama\n"
              "    from . import comm\n")
    found = imported_modules(source, "fourfold.parallel")
    assert {"torch", "fourfold.train.trainer", "fourfold.models.llama",
            "fourfold.parallel.comm"} <= found
