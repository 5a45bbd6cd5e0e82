"""`model.name` resolution: a local model folder, a built-in alias (imported on first use, gguf_import.py), a name
imported into the model cache (cache.py), or a Hugging Face Hub id (hub.py).
"""

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from slipstream.models.cache import is_model_dir, models_dir
from slipstream.models.gguf_import import ALIASES, import_model, known_aliases
from slipstream.models.hub import is_hub_id, resolve_hub_id

if TYPE_CHECKING:
    from slipstream.config.shared import ModelConfig


ModelNameKind = Literal["folder", "alias", "imported", "hub_id"]
"""What a `model.name` names: a local model folder, a known alias, a name imported into the model cache, or a
Hugging Face Hub id."""

_KIND_WORDS: dict[str, str] = {
    "folder": "a local model folder",
    "alias": "a built-in alias",
    "imported": "a model imported into the slipstream cache",
    "hub_id": "a Hugging Face Hub id",
}


def classify_model_name(name: str, cache_dir: Path | None = None) -> ModelNameKind:
    """What `name` names, tried in this order: an existing model folder (a folder wins over a hub id of the same
    spelling), a built-in alias, a name imported into the cache, a hub id. Raises ValueError saying what was tried."""
    path = Path(name).expanduser()
    if is_model_dir(path):
        return "folder"
    if name in ALIASES:
        return "alias"
    if name and "/" not in name and is_model_dir(models_dir(cache_dir) / name):
        return "imported"
    if not path.is_dir() and is_hub_id(name):
        return "hub_id"
    raise ValueError(_unknown_name_message(name, path))


def _unknown_name_message(name: str, path: Path) -> str:
    """Why `name` names no model, told apart: a folder without config.json, a missing folder, an unknown alias."""
    if path.is_dir():
        return (
            f"model.name '{name}' is neither a model folder nor a known alias (known: {known_aliases()}) ('{name}' is a "
            f"directory without config.json); give a folder holding a Hugging Face model (config.json, weights)"
        )
    if "/" in name or os.sep in name or name.startswith(("~", ".")):
        return (
            f"model.name '{name}' is not a model folder ({path.resolve()} does not exist) nor a Hugging Face Hub id "
            f"(those look like org/name, e.g. Qwen/Qwen3-0.6B); fix the path or the id"
        )
    return (
        f"model.name '{name}' is neither a model folder nor a known alias (known: {known_aliases()}); "
        f"run `slipstream model import <alias or file.gguf>`, or give a Hugging Face Hub id as org/name "
        f"(e.g. Qwen/Qwen3-0.6B)"
    )


def resolve_model(
    name: str, revision: str | None = None, cache_dir: Path | None = None, local_files_only: bool = False
) -> Path:
    """A local HF model folder for `name`: an existing folder, a known alias (imported on first use), a name already
    imported into the cache (e.g. a GGUF file stem), or a Hugging Face Hub id at `revision` (downloaded on first use
    unless `local_files_only` or HF_HUB_OFFLINE)."""
    kind = classify_model_name(name, cache_dir)
    if revision is not None and kind != "hub_id":
        raise ValueError(
            f"model.revision '{revision}' only applies to Hugging Face Hub ids, but model.name '{name}' is "
            f"{_KIND_WORDS[kind]}; unset model.revision"
        )
    if kind == "folder":
        return Path(name).expanduser().resolve()
    if kind == "alias":
        return import_model(name, cache_dir=cache_dir)
    if kind == "imported":
        return models_dir(cache_dir) / name
    return resolve_hub_id(name, revision, local_files_only=local_files_only)


def resolve_model_config(model: "ModelConfig", local_files_only: bool = False) -> Path:
    """The folder to load `model` from: `model.path` when the launcher resolved it already (no second resolution,
    no download), else `model.name` at `model.revision` resolved here."""
    if model.path is None:
        return resolve_model(model.name, model.revision, local_files_only=local_files_only)
    if not is_model_dir(model.path):
        raise ValueError(
            f"model.path {model.path} (the folder model.name '{model.name}' was resolved to) is not a model folder "
            f"on this machine (no config.json); unset model.path to resolve model.name again"
        )
    return model.path
