"""Resolve the run's model once, in the launcher, before any process starts: an alias is imported and a hub id
downloaded here, and the local folder is recorded as `model.path` in every section, so the processes (which would
otherwise race on the same download) only read that folder."""

from slipstream.config.base import BaseConfig
from slipstream.config.rl import RLConfig
from slipstream.config.shared import ModelConfig


def resolve_run_model(config: RLConfig) -> RLConfig:
    """`config` with `model.path` set to the local folder of `model.name` (at `model.revision`), at the top level and
    in every section that has a model; `model.name` is kept, as it is the name inference serves the model under.
    Raises ValueError (what was tried and the fix) if the model cannot be found or downloaded."""
    from slipstream.models.resolve import resolve_model_config

    path = resolve_model_config(config.model)
    if path == config.model.path:
        return config
    return with_model(config, config.model.model_copy(update={"path": path}))


def with_model(config: RLConfig, model: ModelConfig) -> RLConfig:
    """`config` with `model` at the top level and in each section holding a model (they must stay equal)."""
    update: dict[str, object] = {"model": model}
    for name in type(config).model_fields:
        section = getattr(config, name)
        if isinstance(section, BaseConfig) and isinstance(getattr(section, "model", None), ModelConfig):
            update[name] = section.model_copy(update={"model": model})
    return config.model_copy(update=update)
