"""End to end through real vLLM (CPU build): a tiny random Llama (tied embeddings) trains for 3 steps with weight
sync checks, logs, wandb (offline) and Prometheus."""

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.utils.net import free_port
from tests.e2e.helpers import processes_with_marker, tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# vLLM (CPU, fp32) and transformers (fp32) compute the same function with different kernels; on probe
# tokens their log-probs agreed to ~1e-5 in our runs, so 1e-3 leaves margin without hiding a missed update
# (one training step at this learning rate moves them by > 1e-2).
LOGPROB_TOLERANCE = 1e-3
MIN_CHANGE_PER_STEP = 1e-3


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class StepScraper(threading.Thread):
    """Polls the trainer's and the orchestrator's Prometheus endpoints while the run lives; keeps the largest
    `slipstream_step` each served (parsed with prometheus_client's parser)."""

    def __init__(self, ports: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.ports, self.steps = ports, {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.3):
            for role, port in self.ports.items():
                try:
                    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                    families = list(text_string_to_metric_families(text))
                except (httpx.HTTPError, ValueError):  # not up yet, closing, or cut short as the process exits
                    continue
                for family in families:
                    for sample in family.samples:
                        if sample.name == "slipstream_step":
                            self.steps[role] = max(self.steps.get(role, 0), sample.value)


def test_three_steps_with_verified_weight_updates(tiny_model_factory, tmp_path, run_env):
    """llama, whose tied LM head vLLM's in-place reload must refresh (the other e2e runs train qwen3); the run also
    feeds wandb (offline) and the Prometheus endpoints."""
    marker, env = run_env
    out = tmp_path / "run"
    config = tiny_rl_config(tiny_model_factory("llama"), out, max_steps=3)
    port = free_port(count=2)  # trainer on port, orchestrator on port + 1
    config["monitor"] = {"prometheus_port": port, "wandb": {"mode": "offline", "project": "e2e"}}
    # On-policy: after each step the trainer waits while inference loads its weights and generates the next
    # batch, so its endpoint serves a step for seconds. With max_async_level = 1 the next batches can be
    # ready already and the trainer can run steps 1-3 and exit between two polls (seen in CI).
    config["orchestrator"]["max_async_level"] = 0
    cfg = write_config(tmp_path / "rl.toml", config)
    scraper = StepScraper({"trainer": port, "orchestrator": port + 1})
    scraper.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "slipstream", "rl", "-c", str(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=840,
        )
    finally:
        scraper.done.set()
        scraper.join()
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert scraper.steps.get("trainer", 0) >= 1 and scraper.steps.get("orchestrator", 0) >= 1, scraper.steps
    # one offline wandb run (nothing sent) holding the trainer's and the orchestrator's metrics of each step
    runs = sorted((out / "wandb").rglob("offline-run-*"))
    assert len(runs) == 1, runs
    data = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
    assert b"grad_norm" in data and b"reward/mean" in data and b"policy/lag_mean" in data

    metrics = _read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        for key in ("reward/mean", "reward/std", "loss", "mismatch_kl", "entropy", "grad_norm", "tokens_per_s"):
            assert key in m, key
    assert proc.stdout.count("step ") >= 3  # one progress line per step on the console
    for role in ("trainer", "orchestrator"):  # log files: timestamped, levelled records, one line per step
        log = (out / "logs" / f"{role}.log").read_text()
        line = rf"^\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{{3}}Z INFO \[{role}\] step 3/3 \| reward "
        assert re.search(line, log, re.M), log[-3000:]

    records = _read_jsonl(out / "weight_checks.jsonl")
    checks = [c for c in records if c["kind"] == "update"]
    # the noise floor, measured on identical weights before a load (before the first, unless its probe was
    # skipped) and raised by the loads that pass, up to weight_check.max_floor_rise (4) x that: every check is
    # judged against the floor left by the checks before it
    (floor,) = [c for c in records if c["kind"] == "calibration"]
    assert floor["step"] in {0, *(c["step"] for c in checks)} and floor["max_abs_diff"] < LOGPROB_TOLERANCE, floor
    largest = floor["max_abs_diff"]
    for check in checks:
        if check["step"] > floor["step"]:
            assert check["floor_max"] == largest, checks
            if check["raised_floor"]:
                largest = min(max(largest, check["max_abs_diff"]), 4.0 * floor["max_abs_diff"])
    steps = [c["step"] for c in checks]
    # the orchestrator loads the newest published weights (it may skip one: a fast trainer can publish step 2 before
    # step 1 is loaded), and ends serving the final policy
    assert steps == sorted(set(steps)) and steps[0] in (1, 2) and steps[-1] == 3 and len(steps) >= 2, steps
    previous = None
    for check in checks:
        assert check["passed"] and check["max_abs_diff"] <= LOGPROB_TOLERANCE, check
        current = check["inference_logprobs"]
        if previous is not None:
            assert max(abs(a - b) for a, b in zip(current, previous, strict=True)) > MIN_CHANGE_PER_STEP
        previous = current
    # versions inference no longer needs are deleted once a newer one is served: the trained model stays
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["step_3"]
    assert (out / "weights" / "step_3" / "READY").exists()

    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind by the run"
