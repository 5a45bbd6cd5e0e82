"""Fixtures for end-to-end runs."""

import os
import uuid

import pytest

from tests.e2e.helpers import MARKER_VAR


@pytest.fixture
def run_env():
    """Environment for a launcher subprocess, tagged so the test can find all its descendants."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VAR: marker, "PYTHONUNBUFFERED": "1"}
    return marker, env
