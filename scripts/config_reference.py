"""Write docs/configuration.md, the configuration reference, from the config dataclasses.

The reference is read off `fourfold.config.Config` itself, so it cannot drift from the code:
every section is a dataclass field of Config, every key a field of its section; a field whose
type is a dataclass (or an optional one, or a union of them) is a table of its own,
[section.key], and a dataclass with subclasses is documented once per concrete subclass (the
options of each training method under [train.method], for instance). A key's type comes from
its annotation (bool, int, float, str, lists, unions, Literal), its allowed values from the
annotation's Literal or from `fourfold.config.CHOICES` where the module has it, its default
from a default-constructed instance, and its description from the field's
`metadata={"doc": ...}` or else from its comments in the source: the comment lines right above
the field and the trailing `# comment` on its lines.

    python scripts/config_reference.py            # print the reference
    python scripts/config_reference.py --write    # write docs/configuration.md (make docs)
    python scripts/config_reference.py --check    # exit 1 if docs/configuration.md is stale

It lives in scripts/ rather than in the package: it is a maintainer's tool that reads the
package's source text, not something a user of fourfold calls; tests/test_docs.py imports it
to hold docs/configuration.md to the code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from types import ModuleType, UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "configuration.md"

INTRO = """\
# Configuration reference

<!-- Generated from src/fourfold/config.py by scripts/config_reference.py: do not edit by
hand; run `make docs` after changing a config dataclass. -->

A run is configured by a TOML file of the sections below; every key has a default, so a file
names only what it changes, and `fourfold train` without a file trains with the defaults. Any
key can be overridden on the command line, `--set SECTION.KEY=VALUE` (repeatable; a table's
key as `--set SECTION.TABLE.KEY=VALUE`). Precedence: defaults < `model.preset` < the file <
`--set`. A run directory's `config.toml` holds every key as the run resolved it, so
`fourfold train RUN_DIR/config.toml` repeats a run. An unknown key, a value of the wrong type
or an impossible combination stops before anything starts, with one `error:` line naming the
key and what is allowed.
"""


# --------------------------------------------------------------------------------------------
# Reading a dataclass: its fields' comments, types and TOML keys


@functools.lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """field name -> the comment lines right above the field and its trailing comments."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}  # line (1-based) -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        trailing = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                    if n in comments and n in code_lines]
        text = " ".join(above + trailing).strip()
        if text:
            out[node.target.id] = text
    return out


def description(cls: type, f: dataclasses.Field) -> str:
    doc = f.metadata.get("doc") if f.metadata else None
    if doc:
        return str(doc)
    # the class that declares the field holds its comments (a subclass may inherit it)
    return next((text for base in cls.__mro__ if dataclasses.is_dataclass(base)
                 and (text := field_comments(base).get(f.name))), "")


def dataclass_options(typ: Any) -> list[type]:
    """The dataclasses a field of type `typ` may hold (Optional / Union of them), else []."""
    if dataclasses.is_dataclass(typ) and isinstance(typ, type):
        return [typ]
    if get_origin(typ) in (Union, UnionType):
        return [t for t in get_args(typ) if dataclasses.is_dataclass(t) and isinstance(t, type)]
    return []


def concrete(cls: type) -> list[type]:
    """`cls` itself when it has no subclasses, else its dataclass subclasses that have none
    (in the order they were defined), each once: fourfold's own (a method a program registers
    is not in fourfold's reference)."""
    subs = [s for s in cls.__subclasses__()
            if dataclasses.is_dataclass(s) and s.__module__.startswith("fourfold.")]
    if not subs:
        return [cls]
    found: list[type] = []
    for sub in subs:
        for leaf in concrete(sub):
            if leaf not in found:
                found.append(leaf)
    return found


def type_text(typ: Any) -> str:
    """A type as a user reads it in TOML terms."""
    if typ is type(None):
        return "none"
    if typ is bool:
        return "boolean"
    if typ is int:
        return "integer"
    if typ is float:
        return "number"
    if typ is str:
        return "string"
    origin = get_origin(typ)
    if origin is Literal:
        return " / ".join(f"`{toml_value(v)}`" for v in get_args(typ))
    if origin in (list, tuple, typing.List, typing.Tuple):
        args = [a for a in get_args(typ) if a is not Ellipsis]
        return f"list of {type_text(args[0])}s" if args else "list"
    if origin in (Union, UnionType):
        return " or ".join(type_text(a) for a in get_args(typ) if a is not type(None))
    return getattr(typ, "__name__", str(typ))


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if value is None:
        return "(none)"
    return repr(value)


def toml_keys(fields: list[dataclasses.Field], keys: list[str]) -> dict[str, str]:
    """field name -> its TOML key: the same name, or the one key of the section's dict that
    no field is named (a field renamed because its key is a Python keyword: `async`)."""
    names = [f.name for f in fields]
    out = {n: n for n in names if n in keys}
    loose_fields = [n for n in names if n not in out]
    loose_keys = [k for k in keys if k not in names]
    if len(loose_fields) == 1 and len(loose_keys) == 1:
        out[loose_fields[0]] = loose_keys[0]
    return {n: out.get(n, n) for n in names}


def cell(text: str) -> str:
    """Text fit for a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


# --------------------------------------------------------------------------------------------
# Writing the reference


def render_table(path: str, cls: type, instance: Any, keys: list[str],
                 choices: dict[tuple[str, str], tuple[str, ...]],
                 out: list[str]) -> list[tuple[str, dataclasses.Field, list[type]]]:
    """The key table of one section or table; returns its fields that are tables of their
    own, with the dataclasses each may hold."""
    hints = get_type_hints(cls)
    fields = list(dataclasses.fields(cls))
    names = toml_keys(fields, keys)
    tables = []
    rows = []
    for f in fields:
        typ = hints[f.name]
        inner = dataclass_options(typ)
        if inner:
            tables.append((path, f, inner))
            continue
        key = names[f.name]
        kind = type_text(typ)
        allowed = choices.get((path, key))
        if allowed:
            kind = " / ".join(f"`{toml_value(v)}`" for v in allowed)
        default = getattr(instance, f.name) if instance is not None else f.default
        if default is dataclasses.MISSING:
            default_text = "(required)"
        else:
            default_text = f"`{toml_value(default)}`"
        rows.append(f"| `{key}` | {cell(kind)} | {cell(default_text)} | "
                    f"{cell(description(cls, f))} |")
    if rows:
        out += ["| key | type | default | what it does |", "|---|---|---|---|", *rows, ""]
    return tables


def render_section(path: str, cls: type, instance: Any, keys: list[str],
                   choices: dict[tuple[str, str], tuple[str, ...]], out: list[str],
                   level: int = 2, title: str | None = None) -> None:
    out += [f"{'#' * level} {title or f'[{path}]'}", ""]
    doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") \
        else None
    if doc:
        out += [doc.split("\n\n")[0].replace("\n", " "), ""]
    tables = render_table(path, cls, instance, keys, choices, out)
    for parent, f, options in tables:
        sub = f"{parent}.{f.name}"
        note = description(cls, f)
        leaves = [leaf for option in options for leaf in concrete(option)]
        if len(leaves) == 1:
            value = getattr(instance, f.name, None) if instance is not None else None
            leaf = leaves[0]
            render_section(sub, leaf, value if isinstance(value, leaf) else leaf(),
                           [x.name for x in dataclasses.fields(leaf)], choices, out, level + 1)
            continue
        out += [f"{'#' * (level + 1)} [{sub}]", ""]
        if note:
            out += [note[0].upper() + note[1:] + ("" if note.endswith(".") else "."), ""]
        for leaf in leaves:
            render_section(sub, leaf, leaf(), [x.name for x in dataclasses.fields(leaf)],
                           choices, out, level + 2, title=f"`{leaf.__name__}`")


def presets_table(config: ModuleType) -> list[str]:
    """The model presets (fourfold.config.PRESETS), with their parameter counts."""
    presets = getattr(config, "PRESETS", None)
    if not isinstance(presets, dict) or not presets:
        return []
    from fourfold.plan.scaling import count_params  # arithmetic: no model is built

    columns = list(dict.fromkeys(k for shape in presets.values() for k in shape))
    out = ["## Model presets", "",
           "`model.preset` sets every `[model]` key below at once; keys the file or `--set` "
           "gives win over the preset's. `custom` uses the `[model]` keys alone.", "",
           "| preset | parameters | " + " | ".join(f"`{c}`" for c in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
    for name, shape in presets.items():
        params = count_params(config.model_config(name))
        size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
        out.append(f"| `{name}` | {size} | "
                   + " | ".join(toml_value(shape[c]) if c in shape else "" for c in columns)
                   + " |")
    return out + [""]


def render() -> str:
    """The whole reference, as docs/configuration.md holds it."""
    import fourfold.config as config

    root = config.Config()
    as_dict = root.to_dict()
    choices = getattr(config, "CHOICES", {})
    out = [INTRO]
    hints = get_type_hints(config.Config)
    for f in dataclasses.fields(config.Config):
        (cls,) = dataclass_options(hints[f.name])[:1] or (None,)
        if cls is None:
            continue
        keys = list(as_dict.get(f.name, {}))
        render_section(f.name, cls, getattr(root, f.name), keys, choices, out)
    out += presets_table(config)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {OUTPUT.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true",
                      help=f"exit 1 if {OUTPUT.relative_to(ROOT)} differs from the code")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        OUTPUT.parent.mkdir(parents=True, exist_ok=True)
        OUTPUT.write_text(text)
        print(OUTPUT.relative_to(ROOT))
    elif args.check:
        current = OUTPUT.read_text() if OUTPUT.is_file() else ""
        if current != text:
            print(f"error: {OUTPUT.relative_to(ROOT)} is stale: run `make docs`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
