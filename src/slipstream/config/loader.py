"""Build a config from TOML files (`-c`, repeatable, later wins) and dotted CLI overrides (`--a.b.c value`).

An override's value is read as a TOML value (`3`, `1e-5`, `true`, `"text"`, `[1, 2]`, `{ a = 1 }`; a JSON object or
array is read too). Where the field takes text (a string or a path), a value TOML reads as something else, or cannot
read, is the text as typed (`--slurm.time_limit 12:00:00`, `--model.revision 1234567`). Nested tables merge, except
that a table given whole as a value (`--orchestrator.env.args '{}'`) replaces the one the files set.
Every user mistake becomes a ConfigError whose message names the key and says what to change.
"""

import difflib
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from slipstream.config.base import ConfigError

C = TypeVar("C", bound=BaseModel)


class CliArgs(NamedTuple):
    """A command line split up: config files, the nested dict of overrides, and the dotted keys of the tables given
    whole (which replace what the files set instead of merging into it)."""

    files: list[Path]
    overrides: dict[str, Any]
    replaced_tables: list[str]


def parse_cli(argv: list[str], cls: type[BaseModel] | None = None) -> CliArgs:
    """Split argv into config files and dotted overrides; `cls` (the config they are for) tells which fields take
    text, so that a value TOML reads as a number, a time or a date stays the text typed there."""
    files: list[Path] = []
    overrides: dict[str, Any] = {}
    replaced: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "--config"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a TOML file path")
            files.append(Path(argv[i + 1]))
            i += 2
            continue
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; options look like --trainer.optim.lr 1e-5")
        key, eq, text = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] not in ("-c", "-h"):
            eq, text, i = "=", argv[i + 1], i + 1
        annotation = annotation_at(cls, key.split(".")) if cls is not None else None
        value = _parse_value(text, annotation) if eq else True  # no value: a bare flag
        _set_dotted(overrides, key, value)
        if isinstance(value, dict):
            replaced.append(key)
        i += 1
    return CliArgs(files, overrides, replaced)


def _parse_value(text: str, annotation: Any) -> Any:
    """`text` as TOML (else as a JSON object or array, else as text); the text itself where the field takes only
    text and TOML reads something else (`12:00:00` is a TOML time, `0` an integer)."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = _json_container(text)
    if not isinstance(value, str) and _takes_only_text(annotation):
        return text
    return value


def _json_container(text: str) -> Any:
    """A JSON object or array (`{"num_tasks": 8}`, as people often write them), else `text` unchanged."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict | list) else text


def _takes_only_text(annotation: Any) -> bool:
    """Whether a field of this annotation accepts only text (str, a path, string literals; optionally None)."""
    if annotation in (str, Path):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return all(isinstance(arg, str) for arg in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return bool(args) and all(_takes_only_text(arg) for arg in args)
    return False


def annotation_at(cls: type[BaseModel], keys: list[str]) -> Any:
    """The annotation of the field at dotted `keys` in `cls` (through nested configs and dict values); None where
    `keys` names no field."""
    annotation: Any = cls
    for key in keys:
        model = _model_of(annotation)
        if model is not None:
            field = model.model_fields.get(key)
            if field is None:
                return None
            annotation = field.annotation
        elif (value_type := _dict_value_type(annotation)) is not None:
            annotation = value_type
        else:
            return None
    return annotation


def _dict_value_type(annotation: Any) -> Any:
    """X of a `dict[str, X]` annotation (also inside an optional one), else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((v for a in typing.get_args(annotation) if (v := _dict_value_type(a)) is not None), None)
    if typing.get_origin(annotation) is dict and len(typing.get_args(annotation)) == 2:
        return typing.get_args(annotation)[1]
    return None


def _set_dotted(target: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    for part in parts[:-1]:
        node = target.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{key}: {part} is a value, not a section")
        target = node
    target[parts[-1]] = value


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Merge `update` into a copy of `base`; nested tables merge, other values replace."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(cls: type[C], argv: list[str]) -> C:
    """Parse `argv` (files + overrides) into a validated `cls`."""
    cli = parse_cli(argv, cls)
    data: dict[str, Any] = {}
    for path in cli.files:
        data = deep_merge(data, read_toml(path))
    for key in cli.replaced_tables:
        _drop_dotted(data, key.split("."))
    return validate_config(cls, deep_merge(data, cli.overrides))


def _drop_dotted(data: dict[str, Any], keys: list[str]) -> None:
    """Remove the value at dotted `keys` from nested `data`, if there is one."""
    for key in keys[:-1]:
        data = data.get(key)
        if not isinstance(data, dict):
            return
    data.pop(keys[-1], None)


def validate_config(cls: type[C], data: dict[str, Any]) -> C:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        # a shared field's mistake shows in every section it is copied into: one line names it, once
        top = set(data) if isinstance(data, dict) else set()
        raise ConfigError("\n".join(dict.fromkeys(_describe(cls, err, top) for err in e.errors()))) from None


def user_key(cls: type[BaseModel], loc: list[str], given: set[str] | None = None) -> list[str]:
    """The key a user sets for the value at `loc`: a field a section gets from the top level (`trainer.max_steps` in
    `slipstream rl`, see `BaseConfig.shared_keys`) is set at the top level (`max_steps`), unless `given` (the top-level
    keys the user gave) lacks it while the section has it: then the user wrote the section's key."""
    shared = getattr(cls, "shared_keys", {})
    if len(loc) >= 2 and loc[0] in shared.get(loc[1], ()) and (given is None or loc[1] in given):
        return loc[1:]
    return loc


def _describe(cls: type[BaseModel], err: Any, given: set[str] | None = None) -> str:
    raw = [str(p) for p in err["loc"]]
    # a missing shared field is set at the top level; a wrong one where the user wrote it
    loc = user_key(cls, raw, None if err["type"] == "missing" else given)
    key = ".".join(loc) or "<config>"
    if not key.isprintable():  # a key with control characters is shown escaped, on one line
        key = ascii(key)
    kind = err["type"]
    if kind == "extra_forbidden":
        known = _field_names(cls, loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = (
            f"; did you mean {'.'.join(user_key(cls, [*loc[:-1], close[0]]))}?"
            if close
            else f"; known keys: {', '.join(known)}"
        )
        return f"unknown key {key}{hint}"
    if kind == "missing":
        return f"{key} is required; set it in the TOML file or with --{key} VALUE"
    msg = err["msg"].removeprefix("Value error, ")
    if kind.startswith("value_error") or not loc:
        return f"{key}: {msg}" if loc else msg
    return f"{key}: {msg} (got {err.get('input')!r})"


def _field_names(cls: type[BaseModel], loc: list[str]) -> list[str]:
    model: Any = cls
    for part in loc:
        field = model.model_fields.get(part) if _is_model(model) else None
        model = _model_of(field.annotation) if field else None
    return sorted(model.model_fields) if _is_model(model) else []


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _model_of(annotation: Any) -> Any:
    if _is_model(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(annotation) if _is_model(a)), None)
    return None


def describe_fields(cls: type[BaseModel], prefix: str = "", defaults: Any = None) -> list[tuple[str, str, str]]:
    """(option, type/default, doc) for every leaf field, for `--help`. `defaults`: the instance a parent's default
    holds, whose values win over the class's own (SFT's `optim = OptimConfig(lr=2e-5)`)."""
    rows: list[tuple[str, str, str]] = []
    for name, field in cls.model_fields.items():
        sub = _model_of(field.annotation)
        key = f"{prefix}{name}"
        value = getattr(defaults, name) if isinstance(defaults, BaseModel) else None
        if sub is not None:
            if value is None and not field.is_required():
                value = field.get_default(call_default_factory=True)
            rows.extend(describe_fields(sub, f"{key}.", value))
            continue
        if isinstance(defaults, BaseModel):
            default = f"default {value!r}"
        else:
            default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
        rows.append(
            (f"--{key}", f"{type_label(field.annotation)}, {default}", " ".join((field.description or "").split()))
        )
    return rows


def help_rows(cls: type[BaseModel], skip: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """`describe_fields` without the options in `skip` (each an option, or a table whose options all go)."""
    return [row for row in describe_fields(cls) if not any(row[0] == s or row[0].startswith(f"{s}.") for s in skip)]


def type_label(annotation: Any) -> str:
    """A field's type for `--help`: Literal values spelled out (`one of {'a', 'b'}`), unions and generics readable."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of {" + ", ".join(repr(value) for value in typing.get_args(annotation)) + "}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_label(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join("..." if arg is Ellipsis else type_label(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
