"""Admin endpoints reject calls without the admin token and accept them with it; inference routes stay open."""

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
