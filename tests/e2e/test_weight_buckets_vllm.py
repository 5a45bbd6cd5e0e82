"""Buckets smaller than vLLM's layers, on the real vLLM CPU build: vLLM's layer-wise reload keeps the tensors a layer's
loaders were given until the layer is complete, while the receiver reuses a bucket's buffer for the bucket after
next. Slipstream's engine copies what vLLM still keeps (transfer_engine.keep_deferred_loads); without that, the
model's own weights sent back came out wrong (prompt log-probs off by 3.3 nats)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SCRIPT = Path(__file__).with_name("vllm_reload_script.py")
BUCKET_BYTES = 100_000
"""Smaller than one layer's q_proj + k_proj + v_proj (131 + 65 + 65 KB in float32): layers straddle buckets."""


def test_layers_straddling_buckets_load_exactly(tiny_qwen3_dir):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_qwen3_dir), str(free_port()), str(BUCKET_BYTES)],
        capture_output=True,
        text=True,
        timeout=500,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["buckets"] >= 10
    before, (halved, own) = result["before"], result["after"]
    assert len(before) == len(own) == len(halved) > 10
    assert max(abs(a - b) for a, b in zip(before, halved, strict=True)) > 0.1  # the update took effect
    assert own == before  # the model's own weights, sent back in small buckets: bit-exact
