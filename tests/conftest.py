"""Shared pytest fixtures: tiny random models (built once per session, per family; treat them as read-only). Under
pytest-xdist, each worker (and every process it starts) keeps to its share of the machine's cores (tests/cores.py)."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.cores import share_cores, visible_cores

if (num_threads := share_cores(os.environ, visible_cores())) is not None:
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`family -> folder` of a tiny random model (seed 0), built on first request and cached for the session."""
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            from slipstream.models.tiny import build_tiny_model

            built[family] = build_tiny_model(family, root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[[str], Path]) -> Path:
    """A tiny model folder; qwen3 unless parametrized: `@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)`."""
    return tiny_model_factory(getattr(request, "param", "qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("qwen3")


@pytest.fixture
def require_isolation() -> None:
    """Security tests never skip: without sandbox isolation they fail, saying why and how to get it."""
    from slipstream.sandbox import detect_isolation

    isolation = detect_isolation()
    if not isolation.available:
        pytest.fail(
            f"sandbox isolation is unavailable ({isolation.reason}): install bubblewrap (`apt-get install "
            "bubblewrap`, which `make setup` does as root) and allow unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1); the sandbox tests do not skip",
            pytrace=False,
        )
