"""Environment registry: name -> constructor, and `build_env` used by the orchestrator. Besides the built-in
names, `orchestrator.env.name` takes an import path (`my_pkg.envs:load_environment`) or a name an installed package
registers under the `slipstream.environments` entry-point group (`slipstream env init NAME` writes such a package).

`build_env` returns a single-turn `Environment` or a `MultiTurnEnvironment`; `slipstream.envs.rollout.run_rollout`
plays both (or wrap with `slipstream.envs.multiturn.as_multi_turn`).
"""

from collections.abc import Callable
from typing import Any

from slipstream.envs.alphabet_sort import AlphabetSortEnv
from slipstream.envs.base import AnyEnvironment
from slipstream.envs.calculator import CalculatorEnv
from slipstream.envs.count_shapes import CountShapesEnv, CountShapesRetryEnv
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
    "count_shapes": CountShapesEnv,
    "count_shapes_retry": CountShapesRetryEnv,
    "verifiers": _verifiers_env,
}


def register_env(name: str, factory: EnvFactory) -> None:
    """Make `factory` buildable as `orchestrator.env.name = name`."""
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered; pick another name")
    _REGISTRY[name] = factory


ENTRY_POINT_GROUP = "slipstream.environments"
"""Installed packages register environments under this entry-point group: `NAME = "pkg.module:load_environment"`."""


def known_envs() -> list[str]:
    """Built-in names and those registered by installed packages."""
    return sorted(set(_REGISTRY) | set(_entry_points()))


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def resolve_env(name: str) -> EnvFactory:
    """The loader of `orchestrator.env.name`: a built-in name, a name an installed package registers under the
    `slipstream.environments` entry-point group, or an import path `package.module:attribute`."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _import_path(name)
    entry_point = _entry_points().get(name)
    if entry_point is None:
        raise ValueError(
            f"unknown environment {name!r} (orchestrator.env.name); known: {', '.join(known_envs())}; or give an "
            "import path 'package.module:load_environment', or install a package that registers the name under "
            f"the {ENTRY_POINT_GROUP!r} entry points (`slipstream env init NAME` writes one)"
        )
    try:
        factory = entry_point.load()
    except Exception as e:  # noqa: BLE001 - any import failure of a third-party package, named with its cause
        raise ValueError(f"environment {name!r}: loading entry point {entry_point.value!r} failed: {e!r}") from e
    return _callable(factory, f"entry point {name!r} = {entry_point.value!r}")


def _import_path(path: str) -> EnvFactory:
    import importlib

    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"orchestrator.env.name {path!r}: an import path is 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"orchestrator.env.name {path!r}: cannot import {module_name!r} ({e}); is its package installed in "
            "this Python, or on PYTHONPATH?"
        ) from e
    factory = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"orchestrator.env.name {path!r}: {module_name!r} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    return _callable(factory, f"orchestrator.env.name {path!r}")


def _callable(factory: Any, where: str) -> EnvFactory:
    if not callable(factory):
        raise ValueError(f"{where} is a {type(factory).__name__}, not a callable returning an environment")
    return factory


def build_env(name: str, **args: Any) -> AnyEnvironment:
    """Construct the environment `name` (see `resolve_env`) with keyword `args` (orchestrator.env.args)."""
    factory = resolve_env(name)
    try:
        env = factory(**args)
    except TypeError as e:
        raise ValueError(f"orchestrator.env.args do not fit environment {name!r}: {e}") from e
    missing = [attr for attr in ("name", "tasks", "reward") if not hasattr(env, attr)]
    if missing:
        raise ValueError(
            f"environment {name!r} built a {type(env).__name__} without {', '.join(missing)}: an environment needs "
            "`name`, `tasks(split)` and `reward(...)` (see slipstream.envs.base and docs/environments.md)"
        )
    return env
