"""Fixtures shared by unit tests."""

import pytest
import torch


@pytest.fixture
def fused(monkeypatch) -> list[int]:
    """The size of every fused copy (`torch._foreach_copy_`) made during the test."""
    sizes = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s, **kw: (sizes.append(len(d)), foreach_copy(d, s, **kw)))
    return sizes
