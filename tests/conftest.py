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


TIER_ORDER = ("e2e", "distributed")
"""Test folders run first, in this order (the rest after them, in collection order). `make test` gives pytest-xdist
whole files in collection order (--dist loadfile --no-loadscope-reorder): the long files (an end-to-end file takes
30-360 s on the 2-core machine) start first and the many short unit files fill in at the end, so the workers end
together. xdist's own order, most tests first, left the one-test end-to-end files for last: one worker ran the last
of them for minutes while the other had nothing left."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the collected tests by TIER_ORDER, keeping each file's tests together and in their order."""

    def tier(item: pytest.Item) -> int:
        parts = Path(str(item.path)).relative_to(Path(__file__).parent).parts
        return TIER_ORDER.index(parts[0]) if len(parts) > 1 and parts[0] in TIER_ORDER else len(TIER_ORDER)

    items.sort(key=tier)  # stable: each tier keeps collection order


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
