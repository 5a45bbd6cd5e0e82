"""Delta updates (`weights.delta`) on the real vLLM CPU build over gloo: a tiny model trains 4 steps, versions 2 and 3
go as changed elements (version 1 is the first, version 4 the every-third full one), each verified by the probe as
exactly as a full send; one delta damaged inside vLLM's worker (tests/e2e/delta_corrupt_ext.py) is caught by its
checksum, never loaded, and sent again whole in the same update."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import free_port, tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_delta_updates_through_vllm_load_exactly_and_repair_a_damaged_delta(tiny_qwen3_dir, tmp_path, run_env):
    _, env = run_env
    out = tmp_path / "run"
    config = tiny_rl_config(
        tiny_qwen3_dir,
        out,
        max_steps=4,
        weights={"transport": "gloo", "master_port": free_port(), "bucket_mb": 1, "delta": {"full_every": 3}},
    )
    config["weights"]["delta"]["enabled"] = True
    # Adam moves every weight by about lr a step: at 3e-3 in float32 nearly every element changes (every bucket goes
    # whole, as it should). At 1e-10 only weights below ~2e-3 in magnitude move by an ulp or more (a few % of them, as
    # bf16 at a usual lr): the delta is smaller than the bucket.
    config["trainer"]["optim"]["lr"] = 1e-10
    config["inference"]["extra_args"] = ["--worker-extension-cls", "tests.e2e.delta_corrupt_ext.DamagedDelta"]
    env = env | {"PYTHONPATH": f"{REPO_ROOT}:{env.get('PYTHONPATH', os.environ.get('PYTHONPATH', ''))}"}
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(write_config(tmp_path / "rl.toml", config))],
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"
    metrics, checks = check_delta_run(out)
    # as exact as a full send (test_rl_tiny: float32 on both sides): far inside the 1e-3 tolerance
    assert max(c["max_abs_diff"] for c in checks) < 1e-4, checks


def check_delta_run(out: Path) -> tuple[dict[int, dict], list[dict]]:
    """The 4-step delta run of `out` (full_every 3, one delta damaged inside vLLM): versions 2 and 3 went as changed
    elements, 1 and 4 whole, the damaged bucket once more whole, every probe passed. Returns (metrics by step, the
    update checks)."""
    metrics = {m["step"]: m for m in _read_jsonl(out / "metrics.jsonl") if "weights/delta_bytes_sent" in m}
    assert sorted(metrics) == [1, 2, 3, 4]
    assert [metrics[s]["weights/delta_full_version"] for s in (1, 2, 3, 4)] == [1.0, 0.0, 0.0, 1.0]
    for step in (2, 3):
        assert metrics[step]["weights/delta_sparse_buckets"] >= 1
        # elements did change, so the damage (which needs a sparse bucket with changes) has something to hit; none do
        # when the learning rate is below what the published dtype resolves (the GPU test publishes bf16)
        assert metrics[step].get("weights/changed_fraction", 0.0) > 0, metrics[step]
    assert sum(m["weights/delta_resent_buckets"] for m in metrics.values()) == 1  # the damaged delta, whole again
    checks = [c for c in _read_jsonl(out / "weight_checks.jsonl") if c["kind"] == "update"]
    assert [c["step"] for c in checks][-1] == 4 and all(c["passed"] for c in checks), checks
    logs = "".join(path.read_text(errors="replace") for path in (out / "logs").glob("*.log"))
    assert "'repaired': 1" in logs  # the worker that caught it (weights/receive/receiver.py's stats, logged)
    return metrics, checks
