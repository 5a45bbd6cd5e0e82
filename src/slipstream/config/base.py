"""Base class for all configs: strict (unknown keys are errors), documented, TOML round-trippable."""

from pathlib import Path
from typing import Any, ClassVar

import tomli_w
from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A user-facing configuration error: the message names the key and says what to change."""


class BaseConfig(BaseModel):
    """Strict pydantic model: unknown keys, wrong types, NaN and infinities fail validation (a NaN learning rate or
    an infinite tolerance would otherwise pass a range check or make one meaningless)."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )

    shared_keys: ClassVar[dict[str, tuple[str, ...]]] = {}
    """Top-level keys copied into sections (key -> those sections), set once at the top level: errors in a section's
    copy name the top-level key, once."""

    def to_toml_dict(self) -> dict[str, Any]:
        """Plain dict for TOML output: None values dropped (TOML has no null), paths as strings."""
        return _drop_none(self.model_dump(mode="json"))

    def write_toml(self, path: Path) -> None:
        """Write this config as TOML, atomically."""
        from slipstream.utils.fs import atomic_write_bytes

        atomic_write_bytes(Path(path), tomli_w.dumps(self.to_toml_dict()).encode())


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
