"""Two simulated engines behind a real vllm-router (the PyPI binary), both rendered from inference.deployment:
consistent_hash keeps every turn of a rollout on one engine (counted from each engine's own request records),
round_robin spreads them, and admin calls (pause, weight load, resume, probe check) reach both engines directly."""

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from slipstream.config.inference import InferenceConfig
from slipstream.config.orchestrator import WeightCheckConfig
from slipstream.envs.base import Task
from slipstream.inference.deployment import router_argv
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.weight_check import WeightChecker
from slipstream.rollout.turns import TurnProgress, TurnRequester
from slipstream.rundir import RunDir
from slipstream.utils.net import free_port
from slipstream_sim.app import SimServer
from slipstream_sim.config import SimConfig
from slipstream_sim.policy import sim_logprob
from slipstream_sim.serve import serve_in_thread

pytestmark = pytest.mark.skipif(
    shutil.which("vllm-router") is None and not (Path(sys.executable).parent / "vllm-router").exists(),
    reason="vllm-router is not installed (pip install -e '.[dev]')",
)

# Sessions are random uuids and the router splits them evenly (measured: 177 / 183 requests over 120 rollouts), so
# all NUM_ROLLOUTS landing on one engine has probability 2 * 0.5**20, about 2e-6 (8 rollouts made it 1/128: CI hit it).
NUM_ROLLOUTS, NUM_TURNS = 20, 3


def _config(policy: str) -> InferenceConfig:
    base = free_port(count=3)
    return InferenceConfig(
        model={"name": "sim"},
        port=base,
        deployment={"num_replicas": 2, "router": {"policy": policy, "prometheus_port": free_port(count=1)}},
    )


class Deployment:
    """The sims on the engine ports of `config`, the router in front; `servers[i]` serves config.engine_urls[i]."""

    def __init__(self, config: InferenceConfig, tmp_path: Path) -> None:
        self.config = config
        self.servers = [SimServer(SimConfig(model_name="sim")) for _ in config.engines]
        self.log = tmp_path / f"router-{config.port}.log"

    def __enter__(self) -> "Deployment":
        self._serving = [
            serve_in_thread(server, port=engine.port)
            for server, engine in zip(self.servers, self.config.engines, strict=True)
        ]
        for serving in self._serving:
            serving.__enter__()
        argv = router_argv(self.config)
        assert argv is not None
        self.router = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.config.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.router.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"vllm-router did not start: {self.log.read_text()[-3000:]}"
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.router.terminate()
        self.router.wait(10)
        for serving in self._serving:
            serving.__exit__(None, None, None)

    def chat_records(self) -> list[int]:
        return [sum(r.endpoint == "chat" for r in s.engine.records) for s in self.servers]


def _requester(client: InferenceClient) -> TurnRequester:
    async def ready() -> int:
        return 0

    return TurnRequester(client, {"max_tokens": 4}, 30.0, ready, lambda: 0)


async def play_rollout(client: InferenceClient, counts: Callable[[], Awaitable[list[int]]], index: int) -> list[int]:
    """One multi-turn rollout (NUM_TURNS model turns) through the orchestrator's TurnRequester; the requests each
    engine got meanwhile, as `counts()` (per engine, cumulative) tells them."""
    before = await counts()
    task = Task(id=f"task-{index}", prompt=[{"role": "user", "content": f"question {index}"}])
    model = _requester(client).model_fn(task, TurnProgress())
    messages = list(task.prompt)
    for turn in range(NUM_TURNS):
        reply = await model(messages, [])
        messages += [reply.message, {"role": "user", "content": f"turn {turn}"}]
    return [after - b for after, b in zip(await counts(), before, strict=True)]


async def _play(client: InferenceClient, deployment: Deployment, index: int) -> list[int]:
    async def counts() -> list[int]:
        return deployment.chat_records()

    return await play_rollout(client, counts, index)


def test_consistent_hash_keeps_rollouts_on_one_engine_and_admin_calls_reach_every_engine(tmp_path):
    config = _config("consistent_hash")
    assert config.uses_router and len(config.engine_urls) == 2
    out = tmp_path / "run"
    step = 3
    weights = RunDir(out).weights_dir(step)
    weights.mkdir(parents=True)
    (weights / "READY").write_text("")
    probe = [5, 17, 42, 99]
    RunDir(out).probe_path(step).write_text(
        json.dumps({"token_ids": probe, "logprobs": [sim_logprob(step, t) for t in probe[1:]]})
    )

    async def scenario(deployment: Deployment) -> None:
        async with InferenceClient(config.url, "sim", 30.0, config.engine_urls) as client:
            instances = await client.wait_healthy(30)
            assert instances is not None and set(instances.split(",")) == {s.instance_id for s in deployment.servers}
            per_rollout = [await _play(client, deployment, i) for i in range(NUM_ROLLOUTS)]
            for counts in per_rollout:  # every turn of a rollout on one engine
                assert sorted(counts) == [0, NUM_TURNS], per_rollout
            assert all(deployment.chat_records()), per_rollout  # the rollouts use both engines
            assert await client.get_world_size() == 2
            load = await client.load_weights(step, {"step": step, "path": str(weights)})
            assert load.prefix_cache_reset
            assert [s.engine.version for s in deployment.servers] == [step, step]
            assert [s.num_prefix_cache_resets for s in deployment.servers] == [1, 1]
            checker = WeightChecker(client, out, WeightCheckConfig(max_abs_diff=1e-6), 1e-6)
            check = await checker.verify(step, previous_version=None)
            assert check["passed"] and check["num_engines"] == 2
            assert [sum(r.endpoint == "completions" for r in s.engine.records) for s in deployment.servers] == [1, 1]
            await _play(client, deployment, 0)  # after the update: new requests served at the new version
            assert deployment.servers[0].engine.records[-1].version_at_arrival == step or (
                deployment.servers[1].engine.records[-1].version_at_arrival == step
            )

    with Deployment(config, tmp_path) as deployment:
        asyncio.run(scenario(deployment))


def test_round_robin_spreads_the_turns_of_a_rollout(tmp_path):
    config = _config("round_robin")

    async def scenario(deployment: Deployment) -> None:
        async with InferenceClient(config.url, "sim", 30.0, config.engine_urls) as client:
            await client.wait_healthy(30)
            counts = [await _play(client, deployment, i) for i in range(2)]
            assert all(0 < c < NUM_TURNS for rollout in counts for c in rollout), counts

    with Deployment(config, tmp_path) as deployment:
        asyncio.run(scenario(deployment))
