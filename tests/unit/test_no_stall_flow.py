"""The orchestrator's side of no-stall weight updates (`weights.no_stall`), against a mock vLLM server: a new transfer
session's version loads paused (declared), the next one without /pause, /reset_prefix_cache or /resume:
/start_weight_update, ACCEPT, /update_weights with `stage`, the trainer's DELIVERED awaited, then
/finish_weight_update, whose server time is what the load reports as the stall; a staging failure is told from a lost
server; the config refuses what no-stall cannot serve, naming the field."""

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.config.weights import WeightsConfig
from slipstream.inference.admin_token import HANDLED_MS_HEADER
from slipstream.orchestrator.client import InferenceClient, WeightStagingFailed
from slipstream.orchestrator.weight_loads import WeightLoader
from slipstream.weights.wire.offers import ACCEPT, MANIFEST, OFFER, mark_delivered
from slipstream.weights.wire.published import weights_dir

FINISH_MS = 12.5


class _Server:
    """The vLLM admin routes a weight update calls, recording them; the trainer's DELIVERED is written `delay_s`
    after /update_weights (its broadcast takes that long)."""

    def __init__(self, out, delay_s: float = 0.2) -> None:
        self.out, self.delay_s = out, delay_s
        self.calls: list[str] = []
        self.infos: list[dict] = []
        self.finish_failure: str | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(path)
        if path == "/get_world_size":
            return httpx.Response(200, json={"world_size": 1})
        if path == "/update_weights":
            info = json.loads(request.content)["update_info"]
            self.infos.append(info)
            assert (weights_dir(self.out, info["step"]) / ACCEPT).exists()  # the trainer sends once accepted
            loop = asyncio.get_event_loop()
            loop.call_later(self.delay_s, mark_delivered, self.out, info["step"], "s")
        if path == "/finish_weight_update":
            if self.finish_failure is not None:
                return httpx.Response(500, text=self.finish_failure)
            return httpx.Response(200, json={}, headers={HANDLED_MS_HEADER: str(FINISH_MS)})
        return httpx.Response(200, json={"success": True})


def _client(server: _Server) -> InferenceClient:
    client = InferenceClient("http://engine", "m", request_timeout_s=5)
    client._http = httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(server))
    return client


def _offer(out, step: int) -> None:
    folder = weights_dir(out, step)
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({"version": 1, "step": step, "buckets": []}))
    (folder / OFFER).write_text(json.dumps({"step": step, "backend": "gloo"}))


def test_an_open_sessions_version_is_staged_and_swapped_without_a_pause(tmp_path):
    server = _Server(tmp_path)
    loader = WeightLoader(_client(server), tmp_path, WeightsConfig(transport="gloo", no_stall=True, master_port=1))
    events: list[str] = []
    _offer(tmp_path, 1)
    _offer(tmp_path, 2)

    async def run():
        first = await loader.load(
            1, before_resume=lambda: events.append("serve 1"), on_stall=lambda: events.append("stall")
        )
        server.calls.clear()

        def serve() -> None:
            assert server.calls[-1] == "/finish_weight_update"  # the stamped version switches when the swap returns
            events.append("serve 2")

        def stall() -> None:
            assert server.calls[-1] == "/update_weights" and (weights_dir(tmp_path, 2) / "DELIVERED").exists()
            events.append("stall")

        return first, await loader.load(2, before_resume=serve, on_stall=stall)

    first, second = asyncio.run(run())
    assert not first.staged and "stage" not in server.infos[0]  # a new session: paused, as before
    assert server.calls == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert server.infos[1]["stage"] is True and server.infos[1]["step"] == 2
    assert events == ["stall", "serve 1", "stall", "serve 2"]
    assert second.staged and not second.prefix_cache_reset
    assert second.seconds == pytest.approx(FINISH_MS / 1e3)  # the swap: the only time vLLM did not generate
    assert second.phases["swap_server"] == pytest.approx(FINISH_MS / 1e3)
    assert second.phases["stage"] >= 0.15  # until DELIVERED, while vLLM generated


def test_a_staging_failure_is_not_a_lost_server(tmp_path):
    server = _Server(tmp_path, delay_s=0.0)
    server.finish_failure = '{"error": "slipstream weight staging failed: version 2: RuntimeError: link lost"}'
    client = _client(server)
    loader = WeightLoader(client, tmp_path, WeightsConfig(transport="gloo", no_stall=True, master_port=1))
    _offer(tmp_path, 1)
    _offer(tmp_path, 2)

    async def run():
        await loader.load(1)
        await loader.load(2)

    with pytest.raises(WeightStagingFailed, match="version 2: RuntimeError: link lost"):
        asyncio.run(run())
    assert client.available and loader.session is None  # the next broadcast opens a new session (paused)


@pytest.mark.parametrize("transport", ["auto", "filesystem", "ipc"])
def test_no_stall_is_refused_where_it_cannot_stage(transport):
    with pytest.raises(ValidationError, match=f'weights.no_stall .*weights.transport is "{transport}".*"nccl"'):
        WeightsConfig(transport=transport, no_stall=True)


@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_no_stall_stages_from_either_broadcast(transport):
    assert WeightsConfig(transport=transport, no_stall=True).no_stall


def test_no_stall_is_refused_with_lora(tmp_path):
    with pytest.raises(ValidationError, match="weights.no_stall .* model.lora .* set weights.no_stall = false"):
        OrchestratorConfig(
            model={"name": "m", "lora": {}}, output_dir=tmp_path, max_steps=1,
            weights={"transport": "gloo", "no_stall": True},
        )  # fmt: skip


def test_the_relay_sends_new_requests_while_staging_and_holds_them_from_the_swap(tmp_path):
    """While the workers stage a version new requests go on (`accepting`), but no evaluation may hold the policy; from
    the swap until the load is done new requests wait. The metrics say what was staged and what stalled."""
    from slipstream.orchestrator.weights import WeightRelay

    server = _Server(tmp_path)
    client = _client(server)
    config = OrchestratorConfig(
        model={"name": "m"}, output_dir=tmp_path, max_steps=2, weight_check={"enabled": False},
        weights={"transport": "gloo", "no_stall": True, "master_port": 1},
    )  # fmt: skip
    relay = WeightRelay(client, config)
    states: dict[str, tuple[bool, bool]] = {}
    respond = server.__call__

    def watching(request: httpx.Request) -> httpx.Response:
        states[f"{request.url.path} {len(server.infos)}"] = (relay.accepting, relay.staging)
        return respond(request)

    client._http = httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(watching))
    _offer(tmp_path, 1)
    _offer(tmp_path, 2)

    async def run() -> tuple[dict, dict]:
        await relay.update(1)
        first = relay.take_metrics()
        await relay.update(2)
        return first, relay.take_metrics()

    first, second = asyncio.run(run())
    assert states["/pause 0"] == (False, False)  # version 1: a new session, paused
    assert states["/update_weights 1"] == (True, True)  # version 2 staged: requests go on, no evaluation starts
    assert states["/finish_weight_update 2"] == (False, False)  # the swap: new requests wait
    assert relay.accepting and not relay.staging and relay.served_version == 2
    assert first["weights/num_paused_updates"] == 1 and "timing/weight_stage_s" not in first
    assert second["weights/num_staged_updates"] == 1 and "weights/prefix_cache_reset" not in second
    assert second["timing/weight_pause_s"] == pytest.approx(FINISH_MS / 1e3) and second["timing/weight_stage_s"] > 0.15
