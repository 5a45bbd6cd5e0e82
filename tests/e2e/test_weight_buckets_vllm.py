"""Slipstream's engine inside the real vLLM CPU build, three or four versions by broadcast (the model's weights
halved, its own, halved again, and its own in other buckets or after a parameter moved) in buckets smaller than
vLLM's layers:
- vLLM's layer-wise reload keeps the tensors a layer's loaders were given until the layer is complete, while the
  receiver reuses a bucket's buffer for the bucket after next: the engine copies what vLLM still keeps
  (weights/receive/engine.keep_deferred_loads). Without that the model's own weights came back wrong (log-probs off by
  3.3).
- The copy plan (weights/receive/copy_plan.py): on the CPU build vLLM repacks linear weights for oneDNN through C++ the
  plan cannot watch, and the plan is refused; with the layers' weights kept as loaded (what the GPU build does), the
  first version is recorded and the next is replayed, bit for bit; a version in other buckets goes through
  vLLM's loaders again, and the one after it is replayed from the new plan."""

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
TENSORS = 25
"""The tiny Qwen3's checkpoint tensors (2 layers of 11, embeddings, final norm, LM head)."""


def _reload(model_dir, *flags) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(model_dir), str(free_port()), str(BUCKET_BYTES), *flags],
        capture_output=True,
        text=True,
        timeout=500,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["buckets"] >= 10
    before, (halved, own, halved_again, *own_again) = result["before"], result["after"]
    assert len(before) == len(own) == len(halved) > 10
    assert max(abs(a - b) for a, b in zip(before, halved, strict=True)) > 0.1  # the update took effect
    assert own == before  # the model's own weights, sent back in small buckets: bit-exact
    assert halved_again == halved
    assert all(again == before for again in own_again)
    return result


def test_layers_straddling_buckets_load_exactly_and_repacked_layers_refuse_the_plan(tiny_qwen3_dir):
    plans = _reload(tiny_qwen3_dir)["plans"]
    assert all(p["copies"] is None and p["replays"] == 0 for p in plans), plans
    assert "a temporary that none of the model's parameters got" in plans[0]["refused"]


def test_layers_that_keep_their_weights_are_replayed_and_other_buckets_replanned(tiny_qwen3_dir):
    """Layers keeping their weights as loaded: the first version is recorded, the second replayed from the copy plan.
    The third comes in other buckets: the engine sees in its manifest, before receiving, that they are not the plan's,
    starts vLLM's layer-wise reload, loads it through vLLM's loaders (exactly: the halved weights again) and records a
    plan for the new buckets, which the fourth replays (the model's own weights, bit for bit). One vLLM start for all:
    each costs ~16 s here."""
    plans = _reload(tiny_qwen3_dir, "--unpacked", "--replan")["plans"]
    assert [p["replays"] for p in plans] == [0, 1, 1, 2], plans
    assert all(p["copies"] == TENSORS and p["refused"] is None for p in plans), plans


def test_two_senders_pieces_are_replayed_straight_from_the_wire(tiny_qwen3_dir):
    """Two trainer ranks each send their own rows (uneven: a third and two thirds) on their own lane: the first version
    goes through vLLM's loaders (laid out whole), the second replays the copy plan straight from the buffers the
    pieces arrived in (weights/receive/copy_plan.py `replay_wire`): vLLM's fused q/k/v and gate/up parameters included,
    bit for bit. Then vLLM gives a parameter new memory: the third version finds the plan stale at its first bucket,
    goes through vLLM's loaders and records a new plan (replaying the old one would have written the old memory, and
    the log-probs would not be the halved weights'), and the fourth replays the new plan from the wire."""
    result = _reload(tiny_qwen3_dir, "--unpacked", "--senders", "2", "--moved")
    plans, buckets = result["plans"], result["buckets"]
    assert [p["replays"] for p in plans] == [0, 1, 1, 2], plans
    assert [p["wire_calls"] for p in plans] == [0, buckets, buckets, 2 * buckets], plans
    assert all(p["copies"] == TENSORS and p["refused"] is None for p in plans), plans
