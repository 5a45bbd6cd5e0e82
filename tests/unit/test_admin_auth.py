"""Admin endpoints reject calls without the admin token and accept them with it; inference routes stay open."""

import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from slipstream.inference.auth import AdminTokenMiddleware, admin_headers


def _ok(request):
    return JSONResponse({"ok": True})


@pytest.fixture
def client():
    paths = [
        "/health",
        "/v1/chat/completions",
        "/metrics",
        "/pause",
        "/resume",
        "/collective_rpc",
        "/reset_prefix_cache",
    ]
    app = Starlette(routes=[Route(p, _ok, methods=["GET", "POST"]) for p in paths])
    app.add_middleware(AdminTokenMiddleware, token="s3cret")
    return TestClient(app)


@pytest.mark.parametrize("path", ["/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/unknown_admin"])
def test_admin_calls_need_the_token(client, path):
    assert client.post(path).status_code == 401
    assert client.post(path, headers=admin_headers("wrong")).status_code == 401
    assert client.post(path, headers={"Authorization": "Bearer s3cret"}).status_code == 401  # not the admin header
    expected = 404 if path == "/unknown_admin" else 200
    assert client.post(path, headers=admin_headers("s3cret")).status_code == expected


@pytest.mark.parametrize("path", ["/health", "/v1/chat/completions", "/metrics"])
def test_inference_routes_stay_open(client, path):
    assert client.post(path).status_code == 200


def test_missing_token_refuses_to_start(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_ADMIN_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="SLIPSTREAM_ADMIN_TOKEN is not set"):
        AdminTokenMiddleware(Starlette())


def test_admin_replies_say_how_long_the_server_took(client):
    from slipstream.inference.admin_token import HANDLED_MS_HEADER
    from slipstream.rollout.client import ServerTiming

    reply = client.post("/pause", headers=admin_headers("s3cret"))
    assert reply.status_code == 200 and 0 <= float(reply.headers[HANDLED_MS_HEADER]) < 5000
    timing = ServerTiming.from_headers(reply.headers)  # what the orchestrator's client reads of it
    assert timing.handled_s == float(reply.headers[HANDLED_MS_HEADER]) / 1e3
    assert ServerTiming.from_headers(httpx.Headers({HANDLED_MS_HEADER: "x"})) == ServerTiming(None, None)
    assert HANDLED_MS_HEADER not in client.post("/health").headers  # inference routes are left as they are


def test_resume_says_how_long_the_engine_was_paused(client):
    from slipstream.inference.admin_token import PAUSED_MS_HEADER
    from slipstream.rollout.client import ServerTiming

    assert PAUSED_MS_HEADER not in client.post("/resume", headers=admin_headers("s3cret")).headers  # no pause before
    client.post("/pause", headers=admin_headers("s3cret"))
    client.post("/collective_rpc", headers=admin_headers("s3cret"))
    time.sleep(0.05)
    reply = client.post("/resume", headers=admin_headers("s3cret"))
    paused = ServerTiming.from_headers(reply.headers).paused_s
    # from /pause's arrival to /resume's reply: the sleep between is inside, the headers' 5 s limit is not reached
    assert paused is not None and 0.05 <= paused < 5
    assert ServerTiming.from_headers(client.post("/pause", headers=admin_headers("s3cret")).headers).paused_s is None
    assert PAUSED_MS_HEADER in client.post("/resume", headers=admin_headers("s3cret")).headers
    assert PAUSED_MS_HEADER not in client.post("/resume", headers=admin_headers("s3cret")).headers  # one per pause


def test_a_weight_load_records_the_engines_pause():
    import asyncio

    from slipstream.inference.admin_token import HANDLED_MS_HEADER, PAUSED_MS_HEADER
    from slipstream.orchestrator.client import InferenceClient

    def handle(request: httpx.Request) -> httpx.Response:
        headers = {HANDLED_MS_HEADER: "2.0"}
        if request.url.path == "/resume":
            headers[PAUSED_MS_HEADER] = "42.5"
        return httpx.Response(200, json={"success": True}, headers=headers)

    async def load():
        async with InferenceClient("http://vllm", "tiny", request_timeout_s=5) as client:
            client._http = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(handle))
            return await client.load_weights(5, {"path": "/w/step_5"})

    load = asyncio.run(load())
    assert load.phases["engine_paused"] == 0.0425 and load.phases["pause_server"] == 0.002
