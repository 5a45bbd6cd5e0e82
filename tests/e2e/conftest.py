"""Fixtures for end-to-end runs."""

import os
import uuid

import pytest

from tests.e2e.helpers import MARKER_VAR, TOOL_CALL_PARSER, shared_inference, tiny_rl_config


@pytest.fixture
def run_env():
    """Environment for a launcher subprocess, tagged so the test can find all its descendants."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VAR: marker, "PYTHONUNBUFFERED": "1"}
    return marker, env


@pytest.fixture(scope="session")
def tiny_inference(tiny_qwen3_dir, tmp_path_factory):
    """One vLLM server of `tiny_rl_config`'s flags (the tiny Qwen3) for this worker's session, used in turn by the runs
    that need nothing else of inference (SharedInference.run_config), instead of one server per run. Started at the
    first use, on a port of its own; stopped, leaving nothing behind, when the session ends. It also parses tool calls
    (`inference.tool_call_parser = "hermes"`, TOOL_CALL_PARSER), which only requests that offer tools use, so the
    tool environment's run shares it too."""
    root = tmp_path_factory.mktemp("tiny_inference")
    config = tiny_rl_config(tiny_qwen3_dir, root / "unused", max_steps=1)
    config["inference"]["tool_call_parser"] = TOOL_CALL_PARSER
    with shared_inference(config, root) as server:
        yield server
