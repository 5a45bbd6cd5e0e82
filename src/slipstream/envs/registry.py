"""Environment registry: name -> constructor, and `build_env` used by the orchestrator.

`build_env` returns a single-turn `Environment` or a `MultiTurnEnvironment`; `slipstream.envs.rollout.run_rollout`
plays both (or wrap with `slipstream.envs.multiturn.as_multi_turn`).
"""

from collections.abc import Callable
from typing import Any

from slipstream.envs.alphabet_sort import AlphabetSortEnv
from slipstream.envs.base import AnyEnvironment
from slipstream.envs.calculator import CalculatorEnv
from slipstream.envs.reverse_text import ReverseTextEnv
from slipstream.envs.swe_fix import SweFixEnv
from slipstream.envs.wordle import WordleEnv

EnvFactory = Callable[..., AnyEnvironment]


def _verifiers_env(**args: Any) -> AnyEnvironment:
    # Imported on use: the adapter needs the optional `verifiers` package.
    from slipstream.envs.verifiers_adapter import VerifiersTasksetEnv

    return VerifiersTasksetEnv(**args)


_REGISTRY: dict[str, EnvFactory] = {
    "reverse_text": ReverseTextEnv,
    "alphabet_sort": AlphabetSortEnv,
    "wordle": WordleEnv,
    "calculator": CalculatorEnv,
    "swe_fix": SweFixEnv,
    "verifiers": _verifiers_env,
}


def register_env(name: str, factory: EnvFactory) -> None:
    """Make `factory` buildable as `orchestrator.env.name = name`."""
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered; pick another name")
    _REGISTRY[name] = factory


def known_envs() -> list[str]:
    return sorted(_REGISTRY)


def build_env(name: str, **args: Any) -> AnyEnvironment:
    """Construct the environment registered as `name` with keyword `args` (orchestrator.env.args)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r} (orchestrator.env.name); known: {', '.join(known_envs())}")
    try:
        return _REGISTRY[name](**args)
    except TypeError as e:
        raise ValueError(f"orchestrator.env.args do not fit environment {name!r}: {e}") from e
