"""A colocated run on CPU (`deployment.colocate = true`, the twin of vLLM and the trainer sharing one GPU) with weights
through shared memory (`weights.transport = "ipc"`, the CPU twin of CUDA IPC): the orchestrator puts vLLM's CPU build
to sleep before each batch is written and wakes it before each load (the CPU build frees no memory, but the calls,
the pause and the alternation are the real ones); a tiny model trains with every version laid out in the trainer's
shared buffer and copied in place by Slipstream's engine inside vLLM, verified by the probe as exactly as through
files; the last version is written to disk, and nothing is left in shared memory after the run."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slipstream.weights.wire.offers import DELIVERED, OFFER
from slipstream.weights.wire.published import READY, weights_dir
from slipstream.weights.wire.shared_buffer import SHM_DIR
from tests.e2e.helpers import processes_with_marker, tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MAX_STEPS = 4


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _watch_buffers(proc: subprocess.Popen, marker: str, timeout: float) -> set[Path]:
    """Polls until `proc` exits (killed after `timeout` s): the shared-memory buffers a process of this run (tagged
    `marker`) created, named `slipstream-weights-<name>-<pid>` by weights/wire/shared_buffer.py. Tests running beside
    this one (pytest-xdist) may hold buffers of their own: those are not this run's."""
    ours: set[Path] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run took more than {timeout:.0f} s")
        candidates = set(SHM_DIR.glob("slipstream-weights-*")) - ours
        if candidates:
            pids = set(processes_with_marker(marker))
            ours |= {
                p for p in candidates if p.name.rsplit("-", 1)[-1].isdigit() and int(p.name.rsplit("-", 1)[-1]) in pids
            }
        time.sleep(0.1)
    return ours


def test_colocated_run_with_ipc_transport_trains_with_exact_verified_updates(tiny_qwen3_dir, tmp_path, run_env):
    marker, env = run_env
    out = tmp_path / "run"
    config = tiny_rl_config(
        tiny_qwen3_dir, out, max_steps=MAX_STEPS, weights={"transport": "ipc"}, deployment={"colocate": True}
    )
    path = write_config(tmp_path / "rl.toml", config)
    with open(tmp_path / "rl.out", "w") as stdout, open(tmp_path / "rl.err", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream", "rl", "-c", str(path)], env=env, stdout=stdout, stderr=stderr
        )
    buffers = _watch_buffers(proc, marker, timeout=800)
    logs = {name: (tmp_path / name).read_text()[-3000:] for name in ("rl.out", "rl.err")}
    assert proc.returncode == 0, logs
    assert "colocated on CPU: vLLM and the trainer take turns" in (tmp_path / "rl.out").read_text()
    metrics = _read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    # every batch was handed over with vLLM asleep; from the second on, vLLM was woken for the load before it
    assert all(m["colocate/sleep_level"] == 1 and m["colocate/sleep_s"] >= 0 for m in metrics), metrics
    assert all(m["colocate/wake_s"] >= 0 and m["colocate/trainer_turn_s"] > 0 for m in metrics[1:]), metrics
    assert all(m["policy/lag_max"] <= 1 for m in metrics)
    inference_log = (out / "logs" / "inference.log").read_text()
    assert inference_log.count("sleep mode is not supported on CPU") >= 2 * (MAX_STEPS - 1)  # real calls, CPU build
    checks = [c for c in _read_jsonl(out / "weight_checks.jsonl") if c["kind"] == "update"]
    assert checks and all(c["passed"] for c in checks) and checks[-1]["step"] == MAX_STEPS, checks
    assert max(c["max_abs_diff"] for c in checks) < 1e-4, checks  # float32 both sides: as exact as through files
    shared = [s for s in range(1, MAX_STEPS) if (weights_dir(out, s) / OFFER).exists()]
    for step in shared:  # offered from shared memory, taken by inference, never written to disk
        offer = json.loads((weights_dir(out, step) / OFFER).read_text())
        assert offer["backend"] == "ipc" and offer["shared"]["kind"] == "file", offer
        assert (weights_dir(out, step) / DELIVERED).exists() and not (weights_dir(out, step) / READY).exists()
    assert (weights_dir(out, MAX_STEPS) / READY).exists()  # the trained model stays on disk
    served = {c["step"] for c in checks}
    assert served & set(range(1, MAX_STEPS)), checks  # at least one version came through shared memory
    assert buffers and not any(p.exists() for p in buffers), buffers  # the trainer removed its buffer
