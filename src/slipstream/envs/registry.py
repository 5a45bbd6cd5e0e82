"""Environment registry: name -> constructor, and `build_env` used by the orchestrator."""

from collections.abc import Callable
from typing import Any

from slipstream.envs.base import Environment
from slipstream.envs.reverse_text import ReverseTextEnv

EnvFactory = Callable[..., Environment]

_REGISTRY: dict[str, EnvFactory] = {"reverse_text": ReverseTextEnv}


def register_env(name: str, factory: EnvFactory) -> None:
    """Make `factory` buildable as `orchestrator.env.name = name`."""
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered; pick another name")
    _REGISTRY[name] = factory


def known_envs() -> list[str]:
    return sorted(_REGISTRY)


def build_env(name: str, **args: Any) -> Environment:
    """Construct the environment registered as `name` with keyword `args` (orchestrator.env.args)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r} (orchestrator.env.name); known: {', '.join(known_envs())}")
    try:
        return _REGISTRY[name](**args)
    except TypeError as e:
        raise ValueError(f"orchestrator.env.args do not fit environment {name!r}: {e}") from e
