"""Two real vLLM CPU engines behind the real vllm-router, started by `slipstream rl` itself from
`inference.deployment.num_replicas = 2` on an inference-only node (deployment.run = ["inference"]), the trainer and
orchestrator on a second launcher as a multi-node job runs them. Before training, multi-turn rollouts played one at a
time through the orchestrator's TurnRequester, counted per engine from each engine's own /metrics
(vllm:request_success, prometheus_client's parser): under consistent_hash every turn of a rollout reaches one engine;
through a second router with round_robin in front of the same engines, the turns of a rollout spread over both. Then
a tiny model trains 3 steps of a multi-turn game: every weight update reaches both engines and passes the probe check
on each; both engines serve rollouts and, under consistent_hash, later turns find their rollout's earlier turns in
their engine's prefix cache. (The same per-rollout checks against simulated engines, with their request records:
test_inference_router.py.)"""

import asyncio
import functools
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.config.inference import InferenceConfig
from slipstream.inference.admin_token import TOKEN_ENV
from slipstream.inference.deployment import router_argv
from slipstream.orchestrator.client import InferenceClient
from slipstream.utils.net import free_port
from tests.e2e.helpers import HEALTH_TIMEOUT_S, processes_with_marker, tiny_rl_config, write_config
from tests.e2e.test_inference_router import NUM_TURNS, play_rollout
from tests.e2e.test_rl_tiny import _read_jsonl

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(HEALTH_TIMEOUT_S + 600),
    pytest.mark.skipif(
        shutil.which("vllm-router") is None and not (Path(sys.executable).parent / "vllm-router").exists(),
        reason="vllm-router is not installed (pip install -e '.[dev]')",
    ),
]

NUM_ROLLOUTS = 4
"""Rollouts played one at a time through each router before training."""


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


async def _request_counts(urls: list[str], expected_total: float | None = None) -> list[int]:
    """vllm:request_success of each engine; with `expected_total`, waits (10 s at most) until their sum reaches it
    (an engine counts a request as it finishes it, which can trail the reply by an engine step)."""
    deadline = time.monotonic() + 10
    while True:
        counts = [int((await asyncio.to_thread(_counters, url))["requests"]) for url in urls]
        if expected_total is None or sum(counts) >= expected_total or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.1)


async def _counts_at(urls: list[str], targets: Iterator[int]) -> list[int]:
    return await _request_counts(urls, next(targets))


async def _rollouts_per_engine(router_url: str, urls: list[str], model: str) -> list[list[int]]:
    """NUM_ROLLOUTS multi-turn rollouts through the router at `router_url`, one at a time: the requests each engine
    served during each one."""
    async with InferenceClient(router_url, model, 60.0, urls) as client:
        await client.wait_healthy(30)  # adopts every engine's instance (restart detection behind a router)
        total = sum(await _request_counts(urls))
        per_rollout = []
        for index in range(NUM_ROLLOUTS):
            targets = iter([total, total + NUM_TURNS])  # before: the earlier rollouts counted; after: this one too
            counts = functools.partial(_counts_at, urls, targets)
            per_rollout.append(await play_rollout(client, counts, index))
            total += NUM_TURNS
        return per_rollout


def _start_router(argv: list[str], port: int, log_path: Path) -> subprocess.Popen:
    """vllm-router `argv` on `port`, answering /health."""
    with open(log_path, "w") as log:
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    _wait_http(f"http://127.0.0.1:{port}/health", router, log_path, 60)
    return router


def _wait_http(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"exited with {proc.returncode}: {log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{url} did not answer in {timeout_s:g}s: {log_path.read_text()[-3000:]}"
        time.sleep(0.5)


def test_two_vllm_replicas_behind_the_router_keep_or_spread_rollouts_and_take_every_update(
    tiny_qwen3_dir, tmp_path, run_env
):
    marker, env = run_env
    env = {**env, TOKEN_ENV: "replicas-e2e"}  # the run's admin token, shared by both launchers
    out = tmp_path / "run"
    config = tiny_rl_config(tiny_qwen3_dir, out, max_steps=3)
    config["inference"].update(port=free_port(count=3))
    config["inference"]["deployment"] = {
        "num_replicas": 2,
        "router": {"policy": "consistent_hash", "prometheus_port": free_port(count=1)},
    }
    config["orchestrator"]["env"] = {"name": "wordle", "args": {"num_tasks": 32, "max_guesses": 3}}
    config["weights"] = {"transport": "filesystem"}  # both launchers must agree (the nodes share this filesystem)
    inference_config = InferenceConfig(model=config["model"], **config["inference"])
    urls, model = inference_config.engine_urls, str(tiny_qwen3_dir)
    node = {**config, "output_dir": str(tmp_path / "inference_node"), "deployment": {"run": ["inference"]}}
    launch = [sys.executable, "-m", "slipstream", "rl", "-c"]
    inference_log = tmp_path / "inference_node.log"
    with open(inference_log, "w") as log:
        inference = subprocess.Popen(
            [*launch, str(write_config(tmp_path / "inference.toml", node))], env=env, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    routers: list[subprocess.Popen] = []
    try:
        _wait_http(f"{inference_config.url}/health", inference, inference_log, HEALTH_TIMEOUT_S)
        for url in urls:
            _wait_http(f"{url}/health", inference, inference_log, 60)

        kept = asyncio.run(_rollouts_per_engine(inference_config.url, urls, model))
        assert all(sorted(counts) == [0, NUM_TURNS] for counts in kept), kept  # every turn on one engine

        argv = router_argv(inference_config.model_copy(update={"deployment": _round_robin(inference_config)}))
        rr_port = free_port(count=2)
        rr_prometheus = rr_port + 1
        assert argv is not None
        argv[argv.index("--port") + 1], argv[argv.index("--prometheus-port") + 1] = str(rr_port), str(rr_prometheus)
        routers.append(_start_router(argv, rr_port, tmp_path / "round_robin_router.log"))
        spread = asyncio.run(_rollouts_per_engine(f"http://127.0.0.1:{rr_port}", urls, model))
        assert all(0 < c < NUM_TURNS for counts in spread for c in counts), spread  # every rollout on both engines

        before_training = {url: _counters(url) for url in urls}
        train = {**config, "deployment": {"run": ["trainer", "orchestrator"]}}
        scraper = Scraper(urls)
        scraper.start()
        try:
            proc = subprocess.run(
                [*launch, str(write_config(tmp_path / "rl.toml", train))], env=env, capture_output=True, text=True,
                timeout=600,
            )  # fmt: skip
        finally:
            scraper.done.set()
            scraper.join()
        logs = {p.name: p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log"))} if out.exists() else {}
        assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}\n{logs}"
    finally:
        for router in routers:
            router.terminate()
            router.wait(10)
        inference.send_signal(signal.SIGTERM)
        inference.wait(60)
    assert "starting vllm-router" in inference_log.read_text() + _node_logs(tmp_path / "inference_node")

    assert [m["step"] for m in _read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    checks = [c for c in _read_jsonl(out / "weight_checks.jsonl") if c["kind"] == "update"]  # not the calibration
    assert [c["step"] for c in checks] == [1, 2, 3]
    assert all(c["passed"] and c["num_engines"] == 2 for c in checks), checks  # every engine probed, every step

    assert set(scraper.last) == set(urls), f"no /metrics reading of {set(urls) - set(scraper.last)}"
    for url, counts in scraper.last.items():
        before = before_training[url]
        assert counts["requests"] > before["requests"], (url, counts, before)  # both engines served rollouts
        assert counts["hits"] > before["hits"], (url, counts, before)  # later turns hit their earlier turns' cache

    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind by the run"


def _round_robin(config: InferenceConfig):
    deployment = config.deployment
    return deployment.model_copy(update={"router": deployment.router.model_copy(update={"policy": "round_robin"})})


def _node_logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log"))) if run_dir.exists() else ""
