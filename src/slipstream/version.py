"""The package's version and Python requirement: from the installed distribution's metadata, else from the
pyproject.toml beside the source (a checkout run from `src/` without installing)."""

import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
"""pyproject.toml of a source checkout (src/slipstream/ -> the repository root)."""


def package_version() -> str:
    """Slipstream's version (`slipstream --version`); "unknown" when neither metadata nor pyproject.toml has it."""
    return _project_field("Version", "version") or "unknown"


def requires_python() -> str | None:
    """The Python versions Slipstream supports, as a specifier (`>=3.11`); None when it cannot be read."""
    return _project_field("Requires-Python", "requires-python")


def _project_field(metadata_key: str, pyproject_key: str) -> str | None:
    try:
        value = importlib.metadata.metadata("slipstream").get(metadata_key)
    except importlib.metadata.PackageNotFoundError:
        value = None
    if value:
        return value
    try:
        return tomllib.loads(PYPROJECT.read_text())["project"][pyproject_key]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
