"""Inference lost mid-run, against the simulated server run as a process (so it can be killed with SIGKILL and
started again on the same port): requests in flight fail and their groups are generated again, the served weights
are loaded and verified again before any new request, a silent restart is caught by the instance id, and a
server that never comes back stops the run with a message saying what was waited for."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.pipeline import RolloutPipeline
from slipstream.orchestrator.weights import WeightRelay
from slipstream.rollout.client import InferenceUnavailable
from slipstream.rundir import WEIGHT_CHECKS_FILE
from slipstream_sim import SimConfig, sim_logprob
from tests.e2e.helpers import free_port
from tests.unit.test_async_pipeline import (
    MODEL,
    StubEnv,
    StubSampler,
    assert_true_logprobs,
    config_for,
    publish,
    tasks_by_length,
)

TOKEN_LATENCY_S = 0.05  # a long completion (40 tokens) takes 2 s: long enough to be killed mid-request
RECOVERY = {"timeout_s": 30, "backoff_initial_s": 0.05, "backoff_max_s": 0.2}


class SimProcess:
    """`python -m slipstream_sim` on a fixed port; kill() is a SIGKILL, start() a fresh server."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log, self.proc = port, log, None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        argv = [sys.executable, "-m", "slipstream_sim", "--port", str(self.port)]
        argv += ["--model-name", MODEL, "--token-latency-s", str(TOKEN_LATENCY_S), "--stop-prob", "0.05"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "simulated server did not start"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@pytest.fixture
def sim(tmp_path):
    server = SimProcess(free_port(), tmp_path / "sim.log")
    server.start()
    yield server
    server.stop()


async def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def num_running(url: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


def read_checks(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / WEIGHT_CHECKS_FILE).read_text().splitlines()]


def test_killed_mid_request_regenerates_the_group_after_reloading_the_served_weights(sim, tmp_path):
    tasks = tasks_by_length(SimConfig(model_name=MODEL, stop_prob=0.05), "llll")
    config = config_for(tmp_path, sim.url, spare_batches=0, recovery=RECOVERY)

    async def main():
        async with InferenceClient(config.inference_url, config.model.name, config.request_timeout_s) as client:
            await client.wait_healthy(10)
            relay = WeightRelay(client, config)
            pipeline = RolloutPipeline(client, StubEnv(), StubSampler(tasks), relay, config)
            batches = []
            async with pipeline.running():
                batches.append(await pipeline.next_batch(1))
                publish(config.output_dir, 1)
                await wait_until(lambda: relay.served_version == 1 and relay.accepting)
                await wait_until(lambda: any(g.request_version == 1 for g in pipeline.ledger.in_flight.values()))
                deadline = time.monotonic() + 5
                while await num_running(sim.url) == 0:  # the v1 group's request is being decoded
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                sim.kill()
                await asyncio.to_thread(sim.start)  # a fresh server: policy version 0, nothing in flight
                batches.append(await pipeline.next_batch(2))
                publish(config.output_dir, 2)
                batches.append(await pipeline.next_batch(3))
            return batches, pipeline

    batches, pipeline = asyncio.run(main())
    assert pipeline.num_regenerated >= 1
    metrics = {k: v for _, m in batches[1:] for k, v in m.items()}
    assert metrics["inference/num_recoveries"] == 1 and metrics["pipeline/regenerated_groups"] >= 1
    for rollouts, _ in batches:
        for rollout in rollouts:
            assert_true_logprobs(rollout)  # every token comes from the version it is stamped with
    # the group lost in flight ran again, from scratch, on the restarted server once it served v1 again
    late = [r for rollouts, _ in batches[1:] for r in rollouts if r.request_version >= 1]
    assert late and all(min(r.token_versions) >= 1 for r in late)
    assert all(r.finish_reason in ("length", "stop") for rollouts, _ in batches for r in rollouts)
    restart_checks = [c for c in read_checks(tmp_path) if c["after_restart"]]
    assert [c["step"] for c in restart_checks] == [1] and restart_checks[0]["passed"]


def test_a_silent_restart_is_caught_by_the_instance_id_and_the_weights_reloaded(sim, tmp_path):
    config = config_for(tmp_path, sim.url, recovery=RECOVERY)
    messages = [{"role": "user", "content": "reverse: abc"}]
    sampling = {"max_completion_tokens": 4}

    async def main():
        async with InferenceClient(config.inference_url, config.model.name, config.request_timeout_s) as client:
            first = await client.wait_healthy(10)
            relay = WeightRelay(client, config)
            publish(config.output_dir, 1)
            await relay.update(1)
            sim.kill()
            await asyncio.to_thread(sim.start)  # no request was in flight: nothing failed
            with pytest.raises(InferenceUnavailable, match="the server restarted"):
                await client.chat(messages, sampling, 1, "policy-1")
            assert not relay.accepting
            with pytest.raises(InferenceUnavailable, match="not sent: inference is unavailable"):
                await client.chat(messages, sampling, 1, "policy-1")  # held back until the weights are back
            await relay.ensure_available()
            assert relay.accepting and client.instance != first
            reply = await client.chat(messages, sampling, 1, "policy-1")
            choice = reply["choices"][0]
            return list(zip(choice["token_ids"], choice["logprobs"]["content"], strict=True)), relay.take_metrics()

    tokens, metrics = asyncio.run(main())
    assert tokens and all(entry["logprob"] == sim_logprob(1, t) for t, entry in tokens)  # the reloaded weights
    assert metrics["inference/num_recoveries"] == 1
    checks = read_checks(tmp_path)
    assert [(c["step"], c["after_restart"], c["passed"]) for c in checks] == [(1, False, True), (1, True, True)]


def test_a_server_that_never_comes_back_stops_with_what_was_waited_for(sim, tmp_path):
    config = config_for(tmp_path, sim.url, recovery={**RECOVERY, "timeout_s": 1.0})

    async def main():
        async with InferenceClient(config.inference_url, config.model.name, config.request_timeout_s) as client:
            await client.wait_healthy(10)
            relay = WeightRelay(client, config)
            sim.kill()
            with pytest.raises(InferenceUnavailable, match="ConnectError"):
                await client.get_text("/metrics")
            start = time.monotonic()
            with pytest.raises(TimeoutError) as raised:
                await relay.ensure_available()
            return raised.value, time.monotonic() - start

    error, waited = asyncio.run(main())
    assert waited < 5
    message = str(error)
    assert f"{sim.url}/health" in message and "orchestrator.recovery.timeout_s" in message
    assert "launch.inference_restarts" in message


def test_the_runs_end_lets_a_recovery_that_is_loading_finish(sim, tmp_path):
    """stop() (the last batch is in) while a recovery loads the served weights onto the restarted server: the load
    completes and is verified, instead of being cut off and leaving the server half-loaded for the final load."""
    config = config_for(tmp_path, sim.url, recovery=RECOVERY)
    messages = [{"role": "user", "content": "reverse: abc"}]

    async def main():
        async with InferenceClient(config.inference_url, config.model.name, config.request_timeout_s) as client:
            await client.wait_healthy(10)
            relay = WeightRelay(client, config)
            publish(config.output_dir, 1)
            await relay.update(1)
            loading, load = asyncio.Event(), relay.loader.load

            async def slow_load(version, **kwargs):
                loading.set()
                await asyncio.sleep(0.5)  # the run's end comes in the middle of it
                return await load(version, **kwargs)

            relay.loader.load = slow_load
            sim.kill()
            await asyncio.to_thread(sim.start)
            with pytest.raises(InferenceUnavailable, match="the server restarted"):
                await client.chat(messages, {"max_completion_tokens": 4}, 1, "policy-1")
            watcher = asyncio.create_task(relay.watch(lambda: 1))
            await asyncio.wait_for(loading.wait(), 10)
            relay.stop()
            await asyncio.wait_for(watcher, 10)
            return relay.accepting, relay.served_version, relay.take_metrics()

    accepting, served, metrics = asyncio.run(main())
    assert accepting and served == 1 and metrics["inference/num_recoveries"] == 1
    checks = read_checks(tmp_path)
    assert [(c["step"], c["after_restart"], c["passed"]) for c in checks] == [(1, False, True), (1, True, True)]
