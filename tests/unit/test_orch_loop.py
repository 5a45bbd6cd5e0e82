"""run_orchestrator against a fake vLLM server (streaming chat in vLLM's chunk format) and a fake trainer.

Checks batch files, policy versions per batch (async lag), the weight-load call sequence and weight checks.
"""

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.orchestrator.loop import run_orchestrator
from slipstream.orchestrator.weights import WeightSyncError
from slipstream.rundir import WEIGHT_CHECKS_FILE, RunDir, step_dirs
from slipstream.transport.rollouts import batch_path, read_batch
from slipstream.utils.fs import commit_dir
from slipstream.weights.wire.published import PROBE, READY, weights_dir

MODEL = "fake-model"
PROBE_TOKENS = [5, 17, 42, 99, 3, 250]


def fake_logprob(version: int, token: int) -> float:
    """Log-prob the fake policy of `version` gives `token`: changes with the version, like real weights."""
    return -((token * 7 + version * 13) % 97) / 50.0 - 0.01


class FakeVLLM:
    """Minimal vLLM stand-in: streamed chat with token ids/logprobs (vLLM 0.32's chunks), prompt scoring, /metrics
    and the dev-mode weight endpoints (with /weight_info). `token_delay_s` spaces the streamed tokens; pause(keep) freezes them."""

    def __init__(self, ignore_loads: bool = False, token_delay_s: float = 0.0) -> None:
        self.version = 0
        self.paused = False
        self.updating: int | None = None
        self.ignore_loads = ignore_loads
        self.token_delay_s = token_delay_s
        self.calls: list[str] = []
        self.true_versions: dict[str, list[list[int]]] = {}
        """Request id -> per choice, the version that produced each token (what stamping should recover)."""
        self.request_texts: dict[str, str] = {}
        """Request id -> the last user message (concurrent requests reach the server in any order)."""
        self.closed_streams: list[str] = []
        """Request ids whose stream ended before the last chunk (client disconnect)."""
        self.weight_version = "default"
        self.salt_scopes: set[str] = set()
        """The scope part of the chats' cache salts (`<scope>:policy-<version>`): one per orchestrator start."""
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/pause", self.pause, methods=["POST"]),
            Route("/resume", self.resume, methods=["POST"]),
            Route("/reset_prefix_cache", self.reset, methods=["POST"]),
            Route("/start_weight_update", self.start_update, methods=["POST"]),
            Route("/update_weights", self.update_weights, methods=["POST"]),
            Route("/finish_weight_update", self.finish_update, methods=["POST"]),
            Route("/weight_info", self.weight_info, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({})

    async def metrics(self, request: Request) -> PlainTextResponse:
        labels = '{engine="0",model_name="fake-model"}'
        text = f"vllm:num_requests_waiting{labels} 0.0\nvllm:num_preemptions_total{labels} 0.0\n"
        return PlainTextResponse(text)

    async def pause(self, request: Request) -> JSONResponse:
        self.calls.append(f"pause:{request.query_params.get('mode')}")
        self.paused = True
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> JSONResponse:
        self.calls.append("resume")
        self.paused = False
        return JSONResponse({"status": "resumed"})

    async def reset(self, request: Request) -> JSONResponse:
        self.calls.append("reset_prefix_cache")
        return JSONResponse({"success": True})

    async def start_update(self, request: Request) -> JSONResponse:
        assert self.paused, "weights must be loaded while paused"
        self.updating = None
        return JSONResponse({"message": "Weight update started"})

    async def update_weights(self, request: Request) -> JSONResponse:
        info = (await request.json())["update_info"]
        path = Path(info["path"])
        assert path.is_absolute() and (path / READY).exists() and path.name == f"step_{info['step']}"
        assert self.paused, "weights must be loaded while paused"
        self.calls.append(f"load:{path.name}")
        self.updating = info["step"]
        return JSONResponse({"message": "Weights updated"})

    async def finish_update(self, request: Request) -> JSONResponse:
        version = int((await request.json())["weight_version"])
        assert self.paused and self.updating == version, "finish must follow the update of the same version"
        if not self.ignore_loads:
            self.version = version
        self.weight_version = str(version)
        return JSONResponse({"message": "Weight update finished"})

    async def weight_info(self, request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": self.weight_version})

    async def chat(self, request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        fields = (body["model"], body["logprobs"], body["return_token_ids"], body["top_logprobs"], body["stream"])
        if fields != (MODEL, True, True, 0, True) or not body["stream_options"]["include_usage"]:
            return JSONResponse({"error": f"bad request {body}"}, status_code=400)
        if "max_completion_tokens" not in body:
            return JSONResponse({"error": "no max_completion_tokens"}, status_code=400)
        request_id = f"chatcmpl-{len(self.calls)}"
        scope, salt = body["cache_salt"].split(":", 1)
        self.salt_scopes.add(scope)
        self.calls.append(f"chat:{salt}")
        text = body["messages"][-1]["content"]
        self.request_texts[request_id] = text
        prompt_ids = list((body["messages"][0]["content"] + text).encode())
        answers = [f"<reversed_text>{text[::-1]}</reversed_text>", text, "no idea"]
        choices = [list(answers[i % len(answers)].encode())[: body["max_completion_tokens"]] for i in range(body["n"])]
        return StreamingResponse(self._stream(request_id, prompt_ids, choices), media_type="text/event-stream")

    async def _stream(self, request_id: str, prompt_ids: list[int], choices: list[list[int]]):
        """vLLM's chunk sequence: a role chunk per choice, one chunk per token (choices interleaved), usage, DONE."""
        true = self.true_versions[request_id] = [[] for _ in choices]

        def chunk(**fields) -> str:
            return f"data: {json.dumps({'id': request_id, 'object': 'chat.completion.chunk', **fields})}\n\n"

        finished = False
        try:
            for i in range(len(choices)):
                role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                yield chunk(choices=[role], prompt_token_ids=prompt_ids)
            for t in range(max(len(ids) for ids in choices)):
                for i, ids in enumerate(choices):
                    if t >= len(ids):
                        continue
                    await asyncio.sleep(self.token_delay_s)
                    while self.paused:  # pause(keep): decode frozen
                        await asyncio.sleep(0.005)
                    true[i].append(self.version)
                    entry = {"token": chr(ids[t]), "logprob": fake_logprob(self.version, ids[t]), "top_logprobs": []}
                    choice = {"index": i, "delta": {"content": chr(ids[t])}, "logprobs": {"content": [entry]}}
                    choice |= {"finish_reason": "stop" if t == len(ids) - 1 else None, "token_ids": [ids[t]]}
                    yield chunk(choices=[choice])
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": sum(map(len, choices))}
            yield chunk(choices=[], usage=usage)
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.closed_streams.append(request_id)

    async def completions(self, request: Request) -> JSONResponse:
        body = await request.json()
        assert body["prompt_logprobs"] == 0 and body["temperature"] == 1.0 and body["max_tokens"] == 1
        self.calls.append("score")
        ids = body["prompt"]
        entries = [None] + [{str(t): {"logprob": fake_logprob(self.version, t), "rank": 1}} for t in ids[1:]]
        return JSONResponse({"choices": [{"index": 0, "text": "x", "prompt_logprobs": entries}]})


class ServerThread:
    """Runs an ASGI app with uvicorn on a free loopback port in a daemon thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake vLLM server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def publish_weights(output_dir: Path, step: int) -> None:
    """What the trainer does after step `step`: probe + READY, committed atomically."""
    tmp = output_dir / "weights" / f".tmp_step_{step}"
    tmp.mkdir(parents=True)
    logprobs = [fake_logprob(step, t) for t in PROBE_TOKENS[1:]]
    (tmp / PROBE).write_text(json.dumps({"token_ids": PROBE_TOKENS, "logprobs": logprobs}))
    (tmp / READY).write_text("")
    commit_dir(tmp, weights_dir(output_dir, step))


def fake_trainer(output_dir: Path, max_steps: int, publish_after_batch: int, stop: threading.Event) -> None:
    """Publish weights/step_n once rollouts/step_{n + publish_after_batch} exists (or the last batch does)."""
    for n in range(1, max_steps + 1):
        wait_for = min(n + publish_after_batch, max_steps)
        while not batch_path(output_dir, wait_for, 0).exists():
            if stop.wait(0.01):
                return
        publish_weights(output_dir, n)


def make_config(tmp_path: Path, url: str, **overrides) -> OrchestratorConfig:
    fields = dict(
        model={"name": MODEL},
        output_dir=tmp_path,
        max_steps=3,
        inference_url=url,
        batch_size=6,
        group_size=3,
        num_trainer_ranks=2,
        micro_batch_tokens=512,
        sampling={"temperature": 0.9, "max_tokens": 64},
        env={"name": "reverse_text", "args": {"num_tasks": 5}},
        request_timeout_s=10,
        weights_timeout_s=20,
        health_timeout_s=10,
    )
    return OrchestratorConfig(**{**fields, **overrides})


def run_with_trainer(config: OrchestratorConfig, server: FakeVLLM, publish_after_batch: int) -> None:
    stop = threading.Event()
    trainer = threading.Thread(
        target=fake_trainer, args=(config.output_dir, config.max_steps, publish_after_batch, stop), daemon=True
    )
    with ServerThread(server.app) as srv:
        config.inference_url = srv.url
        trainer.start()
        try:
            run_orchestrator(config)
        finally:
            stop.set()
            trainer.join(timeout=10)


def step_metrics(output_dir: Path, steps: int) -> list[dict]:
    return [read_batch(batch_path(output_dir, n, 0)).metrics for n in range(1, steps + 1)]


def load_calls(step: int) -> list[str]:
    """One in-flight weight update: pause(keep) -> load -> reset cache -> resume -> verify."""
    return ["pause:keep", f"load:step_{step}", "reset_prefix_cache", "resume", "score"]


@pytest.mark.parametrize(
    ("async_level", "publish_after", "versions", "lags"),
    [
        (1, 1, [0, 0, 1], [0, 1, 1]),  # trainer step n overlaps generation of batch n+1
        (0, 0, [0, 1, 2], [0, 0, 0]),  # synchronous
    ],
)
def test_loop_versions_and_weight_loads(tmp_path, async_level, publish_after, versions, lags):
    server = FakeVLLM()
    # No spare groups, so every group is sent for a known batch (spare groups are covered in test_async_pipeline).
    config = make_config(tmp_path, "", max_async_level=async_level, spare_batches=0)
    run_with_trainer(config, server, publish_after)

    for n in range(1, 4):
        batches = [read_batch(batch_path(tmp_path, n, r)) for r in range(2)]
        assert all(b.step == n and b.micro_batches for b in batches)
        assert {b.num_loss_tokens for b in batches} == {
            sum(sum(mb.loss_mask) for b in batches for mb in b.micro_batches)
        }
    metrics = step_metrics(tmp_path, 3)
    assert [m["policy/version"] for m in metrics] == versions
    assert [m["policy/version_oldest"] for m in metrics] == versions  # instant replies: one version per batch
    assert [m["policy/lag_max"] for m in metrics] == lags
    assert all(0.0 < m["reward/mean"] < 1.0 and m["reward/max"] == 1.0 for m in metrics)
    assert all(m["batch/zero_adv_groups"] == 0 for m in metrics)
    assert all(m["pipeline/cancelled_groups"] == m["pipeline/dropped_groups"] == 0 for m in metrics)

    # Chats of a version are sent only once its load is verified, salted within one scope (nothing another run
    # cached is reused, and no prefix-cache reset is needed for that); the run ends serving the final policy. The
    # trainer publishes its last two steps back to back, so the orchestrator may load step 2 before step 3.
    assert len(server.salt_scopes) == 1
    loads = [int(c.removeprefix("load:step_")) for c in server.calls if c.startswith("load:")]
    expected = ["chat:policy-0"] * 2 * (1 + async_level)
    for v in sorted(set(versions) - {0}):
        expected += load_calls(v) + [f"chat:policy-{v}"] * 2 * versions.count(v)
    expected += [call for v in loads[len(set(versions)) - 1 :] for call in load_calls(v)]
    assert server.calls == expected
    assert loads in ([1, 3], [1, 2, 3]) if async_level else loads == [1, 2, 3]

    checks = [json.loads(line) for line in (tmp_path / WEIGHT_CHECKS_FILE).read_text().splitlines()]
    assert [c["step"] for c in checks] == loads
    assert all(c["passed"] and c["max_abs_diff"] < 1e-9 and c["num_tokens"] == len(PROBE_TOKENS) - 1 for c in checks)
    loaded_steps = [i for i in range(1, 3) if versions[i] != versions[i - 1]]
    assert all("weight_sync/max_abs_diff" in metrics[i] for i in loaded_steps)
    assert "weight_sync/max_abs_diff" not in metrics[0]
    # Older published versions are deleted once a newer one is served (no checkpoints here, keep_weights 0).
    assert sorted(step_dirs(RunDir(tmp_path).weights_root)) == [3]


def test_frozen_policy_stops_the_run(tmp_path):
    server = FakeVLLM(ignore_loads=True)
    config = make_config(tmp_path, "", max_async_level=0)
    with pytest.raises(WeightSyncError, match="did not take effect") as info:
        run_with_trainer(config, server, 0)
    assert "max_abs_diff" in str(info.value)
    check = json.loads((tmp_path / WEIGHT_CHECKS_FILE).read_text())
    assert check["step"] == 1 and not check["passed"] and check["max_abs_diff"] > 1e-3
    assert not batch_path(tmp_path, 2, 0).exists()


def test_frozen_policy_warns_without_stop(tmp_path, capsys):
    server = FakeVLLM(ignore_loads=True)
    config = make_config(tmp_path, "", max_async_level=0, weight_check={"stop_on_failure": False})
    run_with_trainer(config, server, 0)
    assert "did not take effect" in capsys.readouterr().out
    assert step_metrics(tmp_path, 3)[1]["weight_sync/max_abs_diff"] > 1e-3


def test_health_timeout_names_the_server(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound but not listening: connection refused
        config = make_config(tmp_path, url, health_timeout_s=0.3)
        with pytest.raises(TimeoutError, match="/health"):
            run_orchestrator(config)


def test_batch_files_decode_as_wire_type(tmp_path):
    server = FakeVLLM()
    config = make_config(tmp_path, "", max_steps=1, num_trainer_ranks=1)
    run_with_trainer(config, server, 0)
    raw = batch_path(tmp_path, 1, 0).read_bytes()
    decoded = msgspec.msgpack.decode(raw)
    assert decoded["step"] == 1 and decoded["rank"] == 0 and decoded["metrics"]["reward/max"] == 1.0


def test_weights_of_another_run_are_refused(tmp_path):
    publish_weights(tmp_path, 3)  # left in output_dir by an earlier run: no batch of this run exists yet
    with ServerThread(FakeVLLM().app) as srv, pytest.raises(RuntimeError, match="weights of another run"):
        run_orchestrator(make_config(tmp_path, srv.url))
    assert not batch_path(tmp_path, 2, 0).exists()
