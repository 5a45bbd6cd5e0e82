"""A version received but not loaded whole (a bucket dropped before the model's loader) is refused by the engine
(weights/receive/receiver.check_loaded), and the orchestrator takes vLLM's HTTP 500 for that refusal, not for a lost
server: the run stops with the reason instead of waiting for a restart."""

import asyncio
from collections.abc import Callable

import httpx
import pytest

from slipstream.orchestrator.client import InferenceClient, WeightUpdateIncomplete
from slipstream.rollout.client import InferenceUnavailable
from slipstream.weights.receive.receiver import ReceiveStats, check_loaded

NAMES = frozenset(f"model.layers.{i}.mlp.up_proj.weight" for i in range(8))


def test_every_tensor_handed_to_the_loader_passes():
    check_loaded(ReceiveStats(3, len(NAMES), 1024, 0.1, "broadcast", NAMES), set(NAMES) | {"extra"})


def test_a_tensor_that_never_reached_the_loader_is_named():
    loaded = {n for n in NAMES if ".layers.1." not in n}
    with pytest.raises(RuntimeError, match=r"weight update incomplete: version 3 .* 1 never reached .*layers\.1\."):
        check_loaded(ReceiveStats(3, len(NAMES), 1024, 0.1, "broadcast", NAMES), loaded)


def _client(server: Callable[[httpx.Request], httpx.Response]) -> InferenceClient:
    """A client whose engine is `server`, a function from request to response."""
    client = InferenceClient("http://engine", "m", request_timeout_s=5)
    client._http = httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(server))
    return client


def _reply(status: int, text: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, text=text)


def test_the_engines_refusal_is_not_a_lost_server():
    message = '{"error": {"message": "slipstream weight update incomplete: version 3 arrived whole", "code": 500}}'
    client = _client(_reply(500, message))
    with pytest.raises(WeightUpdateIncomplete, match="weight update incomplete"):
        asyncio.run(client.post("/update_weights", json={"update_info": {"step": 3}}))
    assert client.available  # no recovery starts: the server is there and said why


def test_other_server_errors_still_mean_a_lost_server():
    client = _client(_reply(500, "Internal Server Error"))
    with pytest.raises(Exception) as raised:
        asyncio.run(client.post("/update_weights", json={"update_info": {"step": 3}}))
    assert not isinstance(raised.value, WeightUpdateIncomplete) and not client.available


def test_a_refused_update_stays_the_error_when_the_resume_after_it_fails():
    """vLLM 0.26 on GPU closes the connection its refusal came on, and the /resume sent next fails like a lost server:
    the refusal must still be what the load raises (else the run recovers a server that was never lost and waits)."""
    calls: list[str] = []
    refusal = '{"error": {"message": "slipstream weight update incomplete: version 3 arrived whole", "code": 500}}'

    def server(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/update_weights":
            return httpx.Response(500, text=refusal)
        if request.url.path == "/resume":
            raise httpx.ReadError("", request=request)
        return httpx.Response(200, json={})

    client = _client(server)
    with pytest.raises(WeightUpdateIncomplete, match="weight update incomplete") as raised:
        asyncio.run(client.load_weights(3, {"step": 3}))
    assert calls == ["/pause", "/start_weight_update", "/update_weights", "/resume"]
    assert any("/resume after it failed too: InferenceUnavailable" in note for note in raised.value.__notes__)


def test_a_resume_that_fails_after_a_good_load_is_raised():
    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/resume":
            raise httpx.ReadError("", request=request)
        return httpx.Response(200, json={"success": True})

    client = _client(server)
    with pytest.raises(InferenceUnavailable, match="/resume failed"):
        asyncio.run(client.load_weights(3, {"step": 3}))
    assert not client.available
