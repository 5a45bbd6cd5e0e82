"""The simulated inference server: latency tails, capacity queueing, pause modes, policy version per token, streamed
chat completions, metrics."""

import ast
import asyncio
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.envs.base import Task
from slipstream.orchestrator.client import InferenceClient
from slipstream.rollout.replies import parse_chat_response
from slipstream.rollout.streaming import StreamedChat
from slipstream_sim import (
    LatencyModel,
    SimConfig,
    SimServer,
    latency_percentiles,
    serve_in_thread,
    sim_logprob,
)
from slipstream_sim.serve import main as sim_main

MESSAGES = [{"role": "user", "content": "reverse: abc"}]


def chat_body(n: int = 1, max_tokens: int = 8, **extra) -> dict:
    """What rollout/client.py sends."""
    body = {"model": "m", "messages": MESSAGES, "n": n, "temperature": 1.0, "max_completion_tokens": max_tokens}
    return {**body, "logprobs": True, "top_logprobs": 0, "return_token_ids": True, "cache_salt": "policy-0", **extra}


def publish(tmp_path: Path, step: int) -> str:
    folder = tmp_path / "weights" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "READY").write_text("")
    return str(folder)


async def gauges(http: httpx.AsyncClient) -> dict[str, float]:
    """The sim's vLLM series, read with prometheus_client's parser (as the orchestrator reads vLLM's)."""
    text = (await http.get("/metrics")).text
    families = text_string_to_metric_families(text)
    return {s.name: float(s.value) for f in families for s in f.samples if s.name.startswith("vllm:")}


def serve(**config):
    server = SimServer(SimConfig(**config))
    return server, serve_in_thread(server)


@pytest.mark.parametrize("dist", ["lognormal", "pareto"])
def test_latency_distribution_has_the_configured_median_and_tail(dist):
    config = SimConfig(request_latency_dist=dist, request_latency_p50_s=0.2, request_latency_tail_ratio=10.0)
    stats = latency_percentiles(config, num_samples=200_000)
    assert stats["p50_s"] == pytest.approx(0.2, rel=0.03)
    assert stats["tail_ratio"] == pytest.approx(10.0, rel=0.1)
    model = LatencyModel.from_config(config)
    assert model.quantile(0.5) == pytest.approx(0.2) and model.quantile(0.99) == pytest.approx(2.0)


def test_pareto_tail_beyond_p99_is_heavier_than_lognormal():
    def p999(dist: str) -> float:
        return LatencyModel(dist, 1.0, 10.0).quantile(0.999)

    assert p999("pareto") > 1.5 * p999("lognormal")
    assert latency_percentiles(SimConfig(request_latency_p50_s=0.3))["tail_ratio"] == 1.0  # ratio 1: constant


def test_chat_reply_has_the_fields_the_orchestrator_reads():
    server, serving = serve(model_name="m", vocab_size=50)
    with serving as url:
        reply = httpx.post(f"{url}/v1/chat/completions", json=chat_body(n=3, max_tokens=5)).json()
        again = httpx.post(f"{url}/v1/chat/completions", json=chat_body(n=3, max_tokens=5)).json()
        wrong_model = httpx.post(f"{url}/v1/chat/completions", json={**chat_body(), "model": "other"})
    rollouts = parse_chat_response(reply, Task(id="t", prompt=MESSAGES), n=3, policy_version=0)
    assert [r.completion_token_ids for r in rollouts] == [c["token_ids"] for c in again["choices"]]  # deterministic
    assert len({tuple(r.completion_token_ids) for r in rollouts}) == 3  # choices differ
    for r, choice in zip(rollouts, reply["choices"], strict=True):
        assert len(r.completion_token_ids) == 5 and all(0 <= t < 50 for t in r.completion_token_ids)
        assert r.completion_logprobs == [sim_logprob(0, t) for t in r.completion_token_ids]
        assert choice["finish_reason"] == "length"
        assert r.completion_text == choice["message"]["content"] and len(r.completion_text) == 5
    assert reply["prompt_token_ids"] == rollouts[0].prompt_token_ids
    assert [(rec.endpoint, rec.cache_salt, rec.n) for rec in server.engine.records] == [("chat", "policy-0", 3)] * 2
    assert wrong_model.status_code == 404


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_pause_keep_freezes_progress_until_resume():
    server, serving = serve(token_latency_s=0.02)

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            start = time.monotonic()
            request = asyncio.create_task(http.post("/v1/chat/completions", json=chat_body(max_tokens=50)))
            await _until(lambda: server.engine.num_running == 1)
            await asyncio.sleep(0.07)
            await http.post("/pause", params={"mode": "keep"})
            frozen_at = server.engine.generation_tokens_total
            assert 1 <= frozen_at < 50
            await asyncio.sleep(0.25)
            assert server.engine.generation_tokens_total == frozen_at and not request.done()
            assert (await gauges(http))["vllm:num_requests_running"] == 1
            await http.post("/resume")
            choice = (await request).json()["choices"][0]
            assert len(choice["token_ids"]) == 50 and choice["finish_reason"] == "length"
            assert time.monotonic() - start >= 1.0 + 0.25  # 50 x 20 ms of decode plus the pause

    with serving as url:
        asyncio.run(scenario(url))


def test_request_spanning_a_weight_update_streams_tokens_of_both_versions(tmp_path):
    server, serving = serve(token_latency_s=0.01)
    path = publish(tmp_path, 3)

    async def scenario(url: str) -> None:
        async with InferenceClient(url, "m", request_timeout_s=10) as client:
            served = {"version": 0}
            chat = StreamedChat(1, lambda: served["version"], "sim")

            async def stream() -> None:
                async for chunk in client.stream_chat(MESSAGES, {"max_completion_tokens": 60}, 1, "policy-0"):
                    chat.add(chunk)

            request = asyncio.create_task(stream())
            await _until(lambda: len(chat.choices[0].token_ids) >= 5)  # tokens arrive as they are decoded
            # pause keep, start/update/finish weight update, reset_prefix_cache, the switch of the stamp, resume
            await client.load_weights(3, {"step": 3, "path": path}, before_resume=lambda: served.update(version=3))
            await request
            (rollout,) = chat.rollouts(Task(id="t", prompt=MESSAGES), 0)
            versions, ids = rollout.token_versions, rollout.completion_token_ids
            k = versions.index(3)
            assert 5 <= k < 60 and versions == [0] * k + [3] * (60 - k) and rollout.finish_reason == "length"
            assert rollout.completion_logprobs == [sim_logprob(v, t) for v, t in zip(versions, ids, strict=True)]
            probe = [5, 17, 42, 99]
            assert await client.score_tokens(probe, "policy-3") == [sim_logprob(3, t) for t in probe[1:]]

    with serving as url:
        asyncio.run(scenario(url))
    assert server.engine.version == 3 and server.engine.loads == [path] and server.num_prefix_cache_resets == 1
    assert [rec.cache_salt.split(":", 1)[1] for rec in server.engine.records] == ["policy-0", "policy-3"]


def test_streamed_chat_matches_the_whole_reply_and_a_disconnect_aborts_it():
    server, serving = serve(model_name="m", vocab_size=50, token_latency_s=0.01)

    async def scenario(url: str) -> None:
        async with InferenceClient(url, "m", request_timeout_s=10) as client:
            chat = StreamedChat(3, lambda: 0, "sim")
            async for chunk in client.stream_chat(MESSAGES, {"max_completion_tokens": 5}, 3, "policy-0"):
                chat.add(chunk)
            streamed = chat.rollouts(Task(id="t", prompt=MESSAGES), 0)
            whole = parse_chat_response(await client.post("/v1/chat/completions", json=chat_body(n=3, max_tokens=5)),
                                        Task(id="t", prompt=MESSAGES), 3, 0)  # fmt: skip
            for a, b in zip(streamed, whole, strict=True):
                assert (a.prompt_token_ids, a.completion_token_ids) == (b.prompt_token_ids, b.completion_token_ids)
                assert (a.completion_logprobs, a.completion_text) == (b.completion_logprobs, b.completion_text)
                assert a.finish_reason == b.finish_reason == "length"
            stream = client.stream_chat(MESSAGES, {"max_completion_tokens": 500}, 1, "policy-0")
            async for chunk in stream:
                if (chunk.get("choices") or [{}])[0].get("token_ids"):
                    break
            await stream.aclose()  # closes the connection: the server aborts the request
            await _until(lambda: server.engine.num_running == 0)
            assert server.engine.generation_tokens_total < 3 * 5 * 2 + 100  # far from the 500 asked for

    with serving as url:
        asyncio.run(scenario(url))


def test_capacity_queues_sequences_and_metrics_report_them():
    server, serving = serve(capacity=2, request_latency_p50_s=0.5)

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert await gauges(http) == {
                "vllm:num_requests_running": 0.0,
                "vllm:num_requests_waiting": 0.0,
                "vllm:prompt_tokens_total": 0.0,
                "vllm:generation_tokens_total": 0.0,
            }
            start = time.monotonic()
            one = asyncio.create_task(http.post("/v1/chat/completions", json=chat_body(n=3, max_tokens=1)))
            two = asyncio.create_task(
                http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1})
            )
            await _until(lambda: server.engine.num_running + server.engine.num_waiting == 4)
            now = await gauges(http)
            assert (now["vllm:num_requests_running"], now["vllm:num_requests_waiting"]) == (2, 2)
            await asyncio.gather(one, two)
            assert 0.99 <= time.monotonic() - start < 3.0  # two waves of 500 ms
            assert (await gauges(http))["vllm:generation_tokens_total"] == 4

    with serving as url:
        asyncio.run(scenario(url))


def test_requests_sent_while_paused_wait_for_resume():
    server, serving = serve()

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            await http.post("/pause", params={"mode": "keep"})
            request = asyncio.create_task(http.post("/v1/chat/completions", json=chat_body(n=2)))
            await _until(lambda: server.engine.num_waiting + server.engine.num_held == 2)
            await asyncio.sleep(0.1)
            assert not request.done() and (await gauges(http))["vllm:num_requests_waiting"] == 2
            await http.post("/resume")
            assert [len(c["token_ids"]) for c in (await request).json()["choices"]] == [8, 8]

    with serving as url:
        asyncio.run(scenario(url))


def test_pause_abort_ends_in_flight_requests_and_wait_drains_them():
    server, serving = serve(token_latency_s=0.01)

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            request = asyncio.create_task(http.post("/v1/chat/completions", json=chat_body(max_tokens=50)))
            await _until(lambda: server.engine.num_running == 1)
            await asyncio.sleep(0.05)  # a few of its 50 tokens (10 ms each) are due
            await http.post("/pause", params={"mode": "abort"})
            choice = (await request).json()["choices"][0]
            assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 50
            await http.post("/resume")

            request = asyncio.create_task(http.post("/v1/chat/completions", json=chat_body(max_tokens=10)))
            await _until(lambda: server.engine.num_running == 1)  # in flight before the pause, however slow the host
            await http.post("/pause", params={"mode": "wait"})  # returns once the request has finished
            assert server.engine.generation_tokens_total == len(choice["token_ids"]) + 10
            assert (await request).json()["choices"][0]["finish_reason"] == "length"

    with serving as url:
        asyncio.run(scenario(url))


def test_weight_loads_are_checked(tmp_path):
    server, serving = serve()
    (tmp_path / "weights" / "step_2").mkdir(parents=True)

    def post(url: str, route: str, body: dict | None = None) -> httpx.Response:
        return httpx.post(f"{url}/{route}", json=body)

    def update(url: str, step: int, path: str) -> httpx.Response:
        return post(url, "update_weights", {"update_info": {"step": step, "path": path}})

    with serving as url:
        assert "POST /pause first" in post(url, "start_weight_update").text
        assert "start_weight_update must be called" in update(url, 1, publish(tmp_path, 1)).text
        httpx.post(f"{url}/pause", params={"mode": "keep"})
        assert post(url, "start_weight_update").status_code == 200
        assert "already active" in post(url, "start_weight_update").text
        assert "READY" in update(url, 2, str(tmp_path / "weights" / "step_2")).text
        assert (
            "broadcast but no group" in post(url, "update_weights", {"update_info": {"step": 1, "manifest": {}}}).text
        )
        staged = post(url, "update_weights", {"update_info": {"step": 1, "manifest": {}, "stage": True}})
        assert staged.status_code == 400 and "set weights.no_stall = false" in staged.text  # no silent paused load
        assert update(url, 1, str(tmp_path / "weights" / "step_1")).status_code == 200
        assert "weight_version" in post(url, "finish_weight_update", {}).text
        assert post(url, "start_weight_update").status_code == 200
        assert update(url, 1, str(tmp_path / "weights" / "step_1")).status_code == 200
        reply = post(url, "finish_weight_update", {"weight_version": "1"})
        assert httpx.get(f"{url}/get_world_size").json() == {"world_size": 1}
    assert reply.status_code == 200 and server.engine.loads[-1].endswith("step_1")
    assert server.engine.version == 1


def test_cli_prints_latency_percentiles(capsys):
    assert sim_main(["--print-latency", "--request-latency-p50-s", "0.5", "--request-latency-tail-ratio", "4"]) == 0
    stats = ast.literal_eval(capsys.readouterr().out)
    assert stats["p50_s"] == pytest.approx(0.5, rel=0.03) and stats["tail_ratio"] == pytest.approx(4.0, rel=0.1)
