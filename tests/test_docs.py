"""The documentation against the code: every `fourfold ...` command in the README, docs/ and
the examples' comments parses, the Python examples import what they name, the links lead
somewhere, and docs/configuration.md is what scripts/config_reference.py makes of the config
dataclasses today."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from fourfold.config import ConfigError, load_config
from fourfold.errors import FourfoldError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
# fenced blocks whose lines are commands to run (```text blocks are output or synopses)
SHELL_FENCES = ("bash", "sh", "shell", "console", "")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```([\w-]*)\n(.*?)^```", text, re.S | re.M)


def shell_lines(text: str) -> list[str]:
    """The command lines of a text's shell blocks, continuation lines joined."""
    lines: list[str] = []
    for lang, body in fenced_blocks(text):
        if lang in SHELL_FENCES:
            lines += body.replace("\\\n", " ").splitlines()
    return lines


def example_comment_lines(path: Path) -> list[str]:
    """Commands in an example config's comments: `#   fourfold ...` lines."""
    return [line.lstrip("#").strip() for line in path.read_text().splitlines()
            if re.match(r"#\s+(fourfold|torchrun|srun|python)\b", line)]


def fourfold_argv(line: str) -> list[str] | None:
    """The arguments a line hands fourfold (`fourfold ...`, or `... -m fourfold ...` under
    python, torchrun or srun), without shell comments; None for any other line."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    if words[:1] == ["fourfold"]:
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "fourfold":
            return words[i + 2:]
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for line in shell_lines(path.read_text()):
            argv = fourfold_argv(line)
            if argv is not None:
                found.append((f"{path.relative_to(ROOT)}: {line.strip()}", argv))
    for path in EXAMPLES:
        for line in example_comment_lines(path):
            argv = fourfold_argv(line)
            if argv is not None:
                found.append((f"{path.relative_to(ROOT)}: {line}", argv))
    return found


def parse_command(argv: list[str]) -> None:
    """Parse `fourfold ARGV` with the named subcommand's own parser, running nothing."""
    if argv[:1] == ["plan"]:
        from fourfold.plan.cli import build_parser
    elif argv[:1] == ["probe"]:
        from fourfold.plan.probe import build_parser
    else:
        from fourfold.cli import build_parser

        build_parser().parse_args(argv)
        return
    build_parser().parse_args(argv[1:])


def set_items(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--set"]


COMMANDS = documented_commands()


def test_the_docs_show_every_command() -> None:
    """The extraction finds the quickstarts (a broken fence would silently check nothing)."""
    named = {argv[0] for _, argv in COMMANDS if argv}
    assert {"train", "prepare", "generate", "eval", "plan", "probe", "convert",
            "report"} <= named, named
    assert len(COMMANDS) >= 40, len(COMMANDS)


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(where: str, argv: list[str]) -> None:
    """The subcommand's parser takes the options as written, and every `--set` names a key
    that exists with a value of its type (checked alone against the defaults: values that
    only make sense together, such as init_from with an adapter, are the run's to judge)."""
    try:
        parse_command(argv)
    except (FourfoldError, SystemExit) as error:
        pytest.fail(f"{where}\n  does not parse: {error}")
    for item in set_items(argv):
        try:
            load_config(None, [item])
        except ConfigError as error:
            message = str(error)
            if "unknown" in message or ": expected" in message or "section.key" in message:
                pytest.fail(f"{where}\n  --set {item}: {message}")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_config_loads(path: Path) -> None:
    load_config(path)


def python_blocks() -> list[tuple[str, str]]:
    return [(f"{path.relative_to(ROOT)} block {i}", body)
            for path in DOCS
            for i, (lang, body) in enumerate(fenced_blocks(path.read_text()))
            if lang == "python"]


@pytest.mark.parametrize("where,code", python_blocks(), ids=[w for w, _ in python_blocks()])
def test_python_example_names_what_exists(where: str, code: str) -> None:
    """A Python example compiles, and each name it imports from fourfold exists."""
    tree = ast.parse(code, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fourfold"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fourfold"):
                    importlib.import_module(alias.name)


def test_links_lead_somewhere() -> None:
    """Every relative link of the README and docs/ names a file that exists, and a link to a
    heading names one that the page has."""
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                            for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_configuration_reference_is_current() -> None:
    """docs/configuration.md is generated from the config dataclasses: after changing one,
    run `make docs` and commit the result."""
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    current = (ROOT / "docs" / "configuration.md").read_text()
    assert current == reference.render(), "docs/configuration.md is stale: run `make docs`"


def test_readme_is_short() -> None:
    """The README is a user's first page; the rest goes to docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    assert lines[0] == "# fourfold" and "make demo" in "\n".join(lines[:6]) \
        and "make test" in "\n".join(lines[:6])
