"""A weight update left open by an orchestrator that died mid-load (found by benchmarks/chaos.py): the inference server
outlives it (another node, an external server) and refuses every later /start_weight_update, so resume failed forever.
The next load closes the stale session and loads its version."""

import asyncio
import json
from pathlib import Path

import httpx

from slipstream.orchestrator.client import InferenceClient
from slipstream_sim import SimConfig, SimServer, serve_in_thread

VLLM_REFUSAL = (
    '{"error": {"message": "start_weight_update called while a weight update is already active. Call '
    'finish_weight_update first.", "type": "InternalServerError", "param": null, "code": 500}}'
)


def _publish(tmp_path: Path, step: int) -> str:
    folder = tmp_path / "weights" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "READY").write_text("")
    return str(folder)


def test_a_load_closes_the_session_a_dead_orchestrator_left_open(tmp_path, caplog):
    server = SimServer(SimConfig())

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:  # the orchestrator that died mid-load
            for path, body in (("/pause", None), ("/start_weight_update", None)):
                assert (await http.post(path, json=body, params={"mode": "keep"})).status_code == 200
            update = {"update_info": {"step": 2, "path": _publish(tmp_path, 2)}}
            assert (await http.post("/update_weights", json=update)).status_code == 200
        async with InferenceClient(url, "m", request_timeout_s=10) as client:  # the resumed one
            await client.load_weights(3, {"step": 3, "path": _publish(tmp_path, 3)})
            assert client.unavailable_reason is None
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            reply = await http.post("/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 2})
            assert reply.status_code == 200, reply.text

    with serve_in_thread(server) as url:
        asyncio.run(scenario(url))
    assert server.engine.version == 3 and not server.engine.paused
    assert "closing a weight update an earlier orchestrator left open" in caplog.text


def test_vllms_http_500_refusal_is_not_taken_for_a_lost_server():
    calls: list[str] = []
    open_session = [True]

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/start_weight_update" and open_session[0]:
            return httpx.Response(500, content=VLLM_REFUSAL.encode())
        if request.url.path == "/finish_weight_update":
            open_session[0] = False
            assert json.loads(request.content) == {"weight_version": "5"}
        return httpx.Response(200, json={})

    async def scenario() -> InferenceClient:
        async with InferenceClient("http://vllm", "tiny", request_timeout_s=5) as client:
            client._http = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(handle))
            await client.load_weights(5, {"path": "/w/step_5"})
            return client

    client = asyncio.run(scenario())
    assert client.unavailable_reason is None
    assert calls == [
        "/pause",
        "/start_weight_update",
        "/finish_weight_update",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
    ]
