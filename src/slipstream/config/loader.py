"""Build a config from TOML files (`-c`, repeatable, later wins) and dotted CLI overrides (`--a.b.c value`).

Every user mistake becomes a ConfigError whose message names the key and says what to change.
"""

import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from slipstream.config.base import ConfigError

C = TypeVar("C", bound=BaseModel)


def parse_cli(argv: list[str]) -> tuple[list[Path], dict[str, Any]]:
    """Split argv into config files and a nested dict of dotted overrides."""
    files: list[Path] = []
    overrides: dict[str, Any] = {}
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
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] not in ("-c", "-h"):
                value, i = argv[i + 1], i + 1
            else:
                value = "true"  # a bare flag
        _set_dotted(overrides, key.replace("-", "_"), _parse_value(value))
        i += 1
    return files, overrides


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


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
    files, overrides = parse_cli(argv)
    data: dict[str, Any] = {}
    for path in files:
        data = deep_merge(data, read_toml(path))
    return validate_config(cls, deep_merge(data, overrides))


def validate_config(cls: type[C], data: dict[str, Any]) -> C:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(cls, err) for err in e.errors())) from None


def _describe(cls: type[BaseModel], err: Any) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc) or "<config>"
    if not key.isprintable():  # a key with control characters is shown escaped, on one line
        key = ascii(key)
    kind = err["type"]
    if kind == "extra_forbidden":
        known = _field_names(cls, loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"; did you mean {'.'.join([*loc[:-1], close[0]])}?" if close else f"; known keys: {', '.join(known)}"
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


def describe_fields(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(option, type/default, doc) for every leaf field, for `--help`."""
    rows: list[tuple[str, str, str]] = []
    for name, field in cls.model_fields.items():
        sub = _model_of(field.annotation)
        key = f"{prefix}{name}"
        if sub is not None:
            rows.extend(describe_fields(sub, f"{key}."))
            continue
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
