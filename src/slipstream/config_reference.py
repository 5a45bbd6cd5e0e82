"""The configuration reference (docs/reference/config.md), generated from the pydantic configs of every `slipstream`
command: each key with its type, default and docstring, grouped by TOML table. Regenerate it with
`python -m slipstream.config_reference` (tests/unit/test_docs.py fails when the committed page is out of date).
"""

import argparse
import difflib
import importlib
import inspect
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from slipstream.cli import CONFIG_COMMANDS
from slipstream.config.loader import _model_of, type_label

DEFAULT_OUT = Path("docs/reference/config.md")
REGENERATE = "python -m slipstream.config_reference"
"""The command that rewrites DEFAULT_OUT (run from the repository root)."""

HEADER = f"""# Configuration reference

Every key of every `slipstream` command's config: its type, its default and what it does. Set keys in a TOML file
(`-c FILE.toml`, repeatable, later files win) or on the command line as dotted overrides (`--trainer.optim.lr 1e-5`);
`slipstream <command> --help` prints the same list. Under `slipstream rl`, `model`, `output_dir`, `max_steps`, `seed`,
`checkpoint`, `weights` and `monitor` are set once at the top level and copied into the sections that use them, so
those sections do not list them.

<!-- Generated from src/slipstream/config/ by `{REGENERATE}`; do not edit by hand. -->
"""


@dataclass
class Section:
    """One TOML table of a config: its dotted path ("" for the top level), its doc and its leaf keys."""

    path: str
    doc: str
    optional: bool = False
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(dotted key, type, default, doc) per key."""


def walk(cls: type[BaseModel], skip: tuple[str, ...], path: str = "", defaults: Any = None) -> list[Section]:
    """The sections of `cls` depth first, a table's own keys before its sub-tables; `defaults` is the instance the
    parent's default holds (its values win over the class's field defaults, e.g. SFT's `optim.lr`)."""
    here = Section(path, _class_doc(cls))
    subsections: list[Section] = []
    for name, info in cls.model_fields.items():
        key = f"{path}.{name}" if path else name
        if any(key == s or key.startswith(f"{s}.") for s in skip):
            continue
        default = getattr(defaults, name) if isinstance(defaults, BaseModel) else _field_default(info)
        sub = _model_of(info.annotation)
        if sub is not None:
            found = walk(sub, skip, key, default if isinstance(default, BaseModel) else None)
            if found:
                found[0].doc = _join(found[0].doc, info.description or "")
                found[0].optional = not info.is_required() and default is None
            subsections += found
            continue
        shown = "required" if info.is_required() else format_default(default)
        here.rows.append((key, type_label(info.annotation), shown, info.description or ""))
    return ([here] if here.rows or not subsections else []) + subsections


def _field_default(info: Any) -> Any:
    return None if info.is_required() else info.get_default(call_default_factory=True)


def _class_doc(cls: type) -> str:
    """The class's own docstring ("" when it has none: not the base class's)."""
    return _clean(cls.__dict__.get("__doc__") or "")


def _clean(doc: str) -> str:
    return inspect.cleandoc(doc) if doc else ""


def _join(first: str, second: str) -> str:
    """`first` then `second` as paragraphs; `second` left out when it says what `first` says."""
    second = _clean(second)
    if not second or second in first or difflib.SequenceMatcher(None, first.lower(), second.lower()).ratio() > 0.8:
        return first
    return f"{first}\n\n{second}" if first else second


def format_default(value: Any) -> str:
    """A default as it would be written in TOML (`None` as "unset": TOML has no null)."""
    if value is None:
        return "unset"
    return f"`{_toml(value)}`"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}" if value else "{}"
    if isinstance(value, BaseModel):
        return _toml(value.model_dump(mode="json"))
    return repr(value)


_CODE = re.compile(r"(`[^`]*`)")
_ESCAPES = str.maketrans({"\\": "\\\\", "|": "\\|", "*": "\\*", "_": "\\_", "[": "\\[", "<": "&lt;", ">": "&gt;"})


def escape(text: str) -> str:
    """Markdown-safe text: characters Markdown would read as markup (emphasis, links, HTML tags, table cells) are
    escaped outside code spans; code spans are kept as they are."""
    return "".join(
        part if part.startswith("`") and part.endswith("`") and len(part) > 1 else part.translate(_ESCAPES)
        for part in _CODE.split(text)
    )


def _cell(doc: str) -> str:
    """A docstring as one table cell: lines joined, list items kept on lines of their own."""
    lines = [line.strip() for line in doc.splitlines()]
    out = ""
    for line in lines:
        if not line:
            continue
        if line.startswith("- ") and out:
            out += "<br>" + escape(line)
        else:
            out += (" " if out else "") + escape(line)
    return out


def render_command(command: str) -> str:
    config_module, config_name, _, _ = CONFIG_COMMANDS[command]
    module = importlib.import_module(config_module)
    cls = getattr(module, config_name)
    skip = tuple(s.removeprefix("--") for s in getattr(module, "HELP_SKIP", ()))
    parts = [f"## slipstream {command}\n", escape(_class_doc(cls)) + "\n"]
    for section in walk(cls, skip):
        title = f"`[{section.path}]`" if section.path else "Top-level keys"
        parts.append(f"### {title} {{#{command}-{section.path.replace('.', '-') or 'top'}}}\n")
        doc = section.doc if section.path else ""
        if section.optional:
            doc = _join(doc, "Optional: the table is absent unless a config sets it.")
        if doc:
            parts.append(_paragraphs(doc) + "\n")
        parts.append("| key | type | default | description |\n|---|---|---|---|")
        parts += [f"| `{key}` | `{kind}` | {default} | {_cell(doc)} |" for key, kind, default, doc in section.rows]
        parts.append("")
    return "\n".join(parts)


def _paragraphs(doc: str) -> str:
    """A docstring as Markdown paragraphs (its list items stay list items)."""
    out = []
    for line in doc.splitlines():
        line = line.strip()
        if line.startswith("- ") and out and out[-1] and not out[-1].startswith("- "):
            out.append("")  # Markdown needs a blank line before a list
        out.append(escape(line))
    return "\n".join(out)


def render() -> str:
    """The whole reference page: one section per config command."""
    order = ["rl", "sft", "eval", "inference", "orchestrator", "trainer"]
    commands = order + sorted(c for c in CONFIG_COMMANDS if c not in order)
    index = "\n".join(f"- [`slipstream {c}`](#slipstream-{c})" for c in commands)
    return "\n".join([HEADER, index, "", *(render_command(c) for c in commands)]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream.config_reference", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"page to write (default: {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from what would be written")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date; regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
