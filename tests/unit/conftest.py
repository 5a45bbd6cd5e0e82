"""Fixtures shared by unit tests, and the `slow` mark on the tests listed in slow_tests.txt (tests/slow_tests.py)."""

import pytest
import torch

from tests.slow_tests import read_slow_tests


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow = read_slow_tests()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def fused(monkeypatch) -> list[int]:
    """The size of every fused copy (`torch._foreach_copy_`) made during the test."""
    sizes = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s, **kw: (sizes.append(len(d)), foreach_copy(d, s, **kw)))
    return sizes
