"""Two real vLLM CPU engines behind the real vllm-router, started by `slipstream rl` itself from
`inference.deployment.num_replicas = 2` (inference/group.py): a tiny model trains 3 steps of a multi-turn game;
every weight update reaches both engines and passes the probe check on each; both engines serve rollouts, counted from
each engine's own /metrics (prometheus_client's parser) while the run is alive, and under consistent_hash the later
turns of a rollout find its earlier turns in their engine's prefix cache. Which engine served which rollout, and
round_robin's spreading, are checked per rollout with simulated engines in test_inference_router.py (vLLM keeps no
per-request record to read back)."""

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.config.inference import InferenceConfig
from tests.e2e.helpers import processes_with_marker, tiny_rl_config, write_config
from tests.e2e.test_inference_router import _free_port_block
from tests.e2e.test_rl_tiny import _read_jsonl

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        shutil.which("vllm-router") is None and not (Path(sys.executable).parent / "vllm-router").exists(),
        reason="vllm-router is not installed (pip install -e '.[dev]')",
    ),
]


def _counters(url: str) -> dict[str, float]:
    """Sums of vLLM's request and prefix-cache counters on one engine's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    wanted = {
        "vllm:request_success": "requests",
        "vllm:prefix_cache_hits": "hits",
        "vllm:prefix_cache_queries": "queries",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            out[wanted[family.name]] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


class Scraper(threading.Thread):
    """Keeps the last successful /metrics reading of every engine while the run is alive (the engines end with it)."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls, self.last = urls, {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for url in self.urls:
                try:
                    self.last[url] = _counters(url)
                except httpx.HTTPError:
                    pass


def test_two_vllm_replicas_behind_the_router_train_and_both_take_every_update(tiny_qwen3_dir, tmp_path, run_env):
    marker, env = run_env
    out = tmp_path / "run"
    config = tiny_rl_config(tiny_qwen3_dir, out, max_steps=3)
    config["inference"].update(port=_free_port_block(3))
    config["inference"]["deployment"] = {
        "num_replicas": 2,
        "router": {"policy": "consistent_hash", "prometheus_port": _free_port_block(1)},
    }
    config["orchestrator"]["env"] = {"name": "wordle", "args": {"num_tasks": 32, "max_guesses": 3}}
    urls = InferenceConfig(model=config["model"], **config["inference"]).engine_urls
    path = write_config(tmp_path / "rl.toml", config)
    scraper = Scraper(urls)
    scraper.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "slipstream", "rl", "-c", str(path)], env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
    finally:
        scraper.done.set()
        scraper.join()
    logs = {p.name: p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log"))} if out.exists() else {}
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}\n{logs}"
    assert "starting vllm-router" in (out / "logs" / "inference.log").read_text()

    assert [m["step"] for m in _read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    checks = _read_jsonl(out / "weight_checks.jsonl")
    assert [c["step"] for c in checks] == [1, 2, 3]
    assert all(c["passed"] and c["num_engines"] == 2 for c in checks), checks  # every engine probed, every step

    assert set(scraper.last) == set(urls), f"no /metrics reading of {set(urls) - set(scraper.last)}"
    for url, counts in scraper.last.items():
        assert counts["requests"] > 0, (url, counts)  # both engines served rollouts
        assert counts["hits"] > 0, (url, counts)  # later turns found their rollout's earlier turns on this engine

    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind by the run"
