"""HTTP surface of the simulator: the OpenAI and dev-mode admin endpoints the orchestrator calls, in vLLM's shapes.
Chat completions stream like vLLM's (stream.py), so clients see every token when it is decoded.
"""

import base64
import io
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from slipstream.inference.instance import InstanceIdMiddleware, new_instance_id
from slipstream_sim.config import SimConfig
from slipstream_sim.engine import Sequence, SimClosedError, SimEngine, SimRequestError
from slipstream_sim.policy import (
    plan_completion,
    request_seed,
    sim_logprob,
    sim_routing,
    token_text,
    tokenize_messages,
    tokenize_text,
)
from slipstream_sim.stream import ChatStream
from slipstream_sim.transfer import SimWeightTransfer

Handler = Callable[[Request], Awaitable[Response]]

_METRICS = (  # vLLM's Prometheus names; counts are per sequence (one per choice), like vLLM v1
    ("vllm:num_requests_running", "gauge", "Sequences being decoded."),
    ("vllm:num_requests_waiting", "gauge", "Sequences waiting for a capacity slot or for /resume."),
    ("vllm:prompt_tokens_total", "counter", "Prompt tokens processed."),
    ("vllm:generation_tokens_total", "counter", "Tokens generated."),
)


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "Error")
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


class _NotFound(SimRequestError):
    pass


def _guarded(handler: Handler) -> Handler:
    """Turn request errors into vLLM-style JSON error replies (400, 404, 503)."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except _NotFound as e:
            return _error(404, str(e))
        except SimRequestError as e:
            return _error(400, str(e))
        except SimClosedError as e:
            return _error(503, str(e))

    return run


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep
        raise SimRequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise SimRequestError("request body must be a JSON object")
    return body


def _int_field(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SimRequestError(f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value


class SimServer:
    """The simulated server: `engine` holds its state (version, records, gauges), `app` is the ASGI app.

    Replies carry `X-Slipstream-Instance: <instance_id>` like `slipstream inference`: a new SimServer served on
    the same port is a restarted server (initial weights, nothing in flight)."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.engine = SimEngine(self.config)
        self.transfer = SimWeightTransfer(self.engine, self.config)
        self.num_prefix_cache_resets = 0
        self._ids = itertools.count()
        self.instance_id = new_instance_id()
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/chat/completions", _guarded(self.chat), methods=["POST"]),
            Route("/v1/completions", _guarded(self.completions), methods=["POST"]),
            Route("/pause", _guarded(self.pause), methods=["POST"]),
            Route("/resume", self.resume, methods=["POST"]),
            Route("/sleep", _guarded(self.sleep), methods=["POST"]),
            Route("/wake_up", _guarded(self.wake_up), methods=["POST"]),
            Route("/is_sleeping", self.is_sleeping, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/init_weight_transfer_engine", _guarded(self.init_weight_transfer), methods=["POST"]),
            Route("/start_weight_update", _guarded(self.start_weight_update), methods=["POST"]),
            Route("/update_weights", _guarded(self.update_weights), methods=["POST"]),
            Route("/finish_weight_update", _guarded(self.finish_weight_update), methods=["POST"]),
            Route("/get_world_size", self.get_world_size, methods=["GET"]),
            Route("/weight_info", self.weight_info, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, middleware=[Middleware(InstanceIdMiddleware, instance=self.instance_id)])

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def chat(self, request: Request) -> Response:
        body = await _json_body(request)
        model = self._check_model(body)
        try:
            prompt_ids = tokenize_messages(body.get("messages"))
        except ValueError as e:
            raise SimRequestError(str(e)) from e
        max_tokens = _int_field(body, "max_completion_tokens", body.get("max_tokens"), 1)
        if body.get("stream"):
            seqs = self.engine.sequences(self._plans(body, "chat", prompt_ids, max_tokens), streamed=True)
            envelope = {"id": f"chatcmpl-sim-{next(self._ids)}", "model": model}
            stream = ChatStream(self.engine, body, envelope, prompt_ids).chunks(seqs)
            return StreamingResponse(stream, media_type="text/event-stream")
        seqs = await self._generate(body, "chat", prompt_ids, max_tokens)
        choices = [self._chat_choice(i, seq, body) for i, seq in enumerate(seqs)]
        if self.config.routed_experts_layers:
            for choice, seq in zip(choices, seqs, strict=True):
                choice["routed_experts"] = self._routed_experts(prompt_ids + seq.token_ids)
        reply = self._envelope("chatcmpl", "chat.completion", model, choices, prompt_ids, seqs)
        if body.get("return_token_ids"):
            reply["prompt_token_ids"] = prompt_ids
        return JSONResponse(reply)

    async def completions(self, request: Request) -> Response:
        body = await _json_body(request)
        model = self._check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            prompt_ids = tokenize_text(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise SimRequestError("'prompt' must be a non-empty string or a non-empty list of token ids")
        prompt_logprobs = _int_field(body, "prompt_logprobs", None, 0)
        seqs = await self._generate(body, "completions", prompt_ids, _int_field(body, "max_tokens", None, 1))
        choices = []
        for i, seq in enumerate(seqs):
            choice = self._completion_choice(i, seq, body)
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs(prompt_ids, seq.prefill_version)
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = prompt_ids
            choices.append(choice)
        return JSONResponse(self._envelope("cmpl", "text_completion", model, choices, prompt_ids, seqs))

    async def pause(self, request: Request) -> Response:
        await self.engine.pause(request.query_params.get("mode", "abort"))  # vLLM's default mode is abort
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        self.engine.resume()
        return JSONResponse({"status": "resumed"})

    async def sleep(self, request: Request) -> Response:
        level = request.query_params.get("level", "1")
        if not level.isdigit():
            raise SimRequestError(f"level must be an integer (got {level!r})")
        await self.engine.sleep(int(level), request.query_params.get("mode", "abort"))
        return JSONResponse({"status": "sleeping", "level": int(level)})

    async def wake_up(self, request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        awake = self.engine.wake_up(tags)
        return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": self.engine.sleeping})

    async def reset_prefix_cache(self, request: Request) -> Response:
        self.num_prefix_cache_resets += 1
        return JSONResponse({"success": True})

    async def init_weight_transfer(self, request: Request) -> Response:
        await self.transfer.init((await _json_body(request)).get("init_info") or {})
        return JSONResponse({"message": "Weight transfer initialized"})

    async def start_weight_update(self, request: Request) -> Response:
        self.transfer.start()
        return JSONResponse({"message": "Weight update started"})

    async def update_weights(self, request: Request) -> Response:
        await self.transfer.update((await _json_body(request)).get("update_info"))
        return JSONResponse({"message": "Weights updated"})

    async def finish_weight_update(self, request: Request) -> Response:
        body = await _json_body(request) if await request.body() else {}
        self.transfer.finish(body.get("weight_version"))
        return JSONResponse({"message": "Weight update finished"})

    async def get_world_size(self, request: Request) -> Response:
        return JSONResponse({"world_size": 1})

    async def weight_info(self, request: Request) -> Response:
        return JSONResponse({"weight_version": self.transfer.weight_version})

    async def metrics(self, request: Request) -> Response:
        e, labels = self.engine, f'{{model_name="{self.config.model_name or "sim"}"}}'
        values = (e.num_running, e.num_held + e.num_waiting, e.prompt_tokens_total, e.generation_tokens_total)
        lines = []
        for (name, kind, help_text), value in zip(_METRICS, values, strict=True):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {float(value)}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def _check_model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if self.config.model_name is not None and model != self.config.model_name:
            raise _NotFound(f"The model `{model}` does not exist; this server serves `{self.config.model_name}`")
        return model if isinstance(model, str) else "sim"

    async def _generate(
        self, body: dict[str, Any], endpoint: str, prompt_ids: list[int], max_tokens: int | None
    ) -> list[Sequence]:
        return await self.engine.generate(self._plans(body, endpoint, prompt_ids, max_tokens), len(prompt_ids))

    def _plans(
        self, body: dict[str, Any], endpoint: str, prompt_ids: list[int], max_tokens: int | None
    ) -> list[tuple[list[int], str]]:
        """The planned choices of a generation request (recorded)."""
        n = _int_field(body, "n", 1, 1)
        max_tokens = max_tokens or self.config.default_max_tokens
        seed = request_seed(self.config.seed, _int_field(body, "seed", None, 0), prompt_ids)
        vocab_size, stop_prob = self.config.vocab_size, self.config.stop_prob
        plans = [plan_completion(seed, i, max_tokens, vocab_size, stop_prob) for i in range(n)]
        self.engine.record(endpoint, body.get("cache_salt"), n, max_tokens)
        return plans

    def _envelope(
        self, prefix: str, kind: str, model: str, choices: list[dict], prompt_ids: list[int], seqs: list[Sequence]
    ) -> dict[str, Any]:
        completion_tokens = sum(len(seq.token_ids) for seq in seqs)
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        }
        return {
            "id": f"{prefix}-sim-{next(self._ids)}",
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage,
        }

    def _routed_experts(self, token_ids: list[int]) -> str:
        """vLLM's `routed_experts` field: base64 `.npy` bytes of the sequence's routing."""
        c = self.config
        routed = sim_routing(
            token_ids, c.routed_experts_layers, c.routed_experts_top_k, c.routed_experts_num_experts, c.seed
        )
        buffer = io.BytesIO()
        np.save(buffer, routed, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    def _chat_choice(self, index: int, seq: Sequence, body: dict[str, Any]) -> dict[str, Any]:
        text = "".join(token_text(t) for t in seq.token_ids)
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": seq.finish_reason,
            "stop_reason": None,
        }
        if body.get("logprobs"):
            content = [
                {"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode()), "top_logprobs": []}
                for t, lp in zip(seq.token_ids, seq.logprobs, strict=True)
            ]
            choice["logprobs"] = {"content": content}
        if body.get("return_token_ids"):
            choice["token_ids"] = seq.token_ids
        return choice

    def _completion_choice(self, index: int, seq: Sequence, body: dict[str, Any]) -> dict[str, Any]:
        texts = [token_text(t) for t in seq.token_ids]
        choice: dict[str, Any] = {
            "index": index,
            "text": "".join(texts),
            "logprobs": None,
            "finish_reason": seq.finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "tokens": texts,
                "token_logprobs": seq.logprobs,
                "top_logprobs": [{s: lp} for s, lp in zip(texts, seq.logprobs, strict=True)],
                "text_offset": list(range(len(texts))),
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = seq.token_ids
        return choice


def _prompt_logprobs(prompt_ids: list[int], version: int | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}} per token
    (only the actual token, whatever k was asked). None if the request was aborted before its prefill."""
    if version is None:
        return None
    entries: list[dict | None] = [None]
    for token_id in prompt_ids[1:]:
        entry = {"logprob": sim_logprob(version, token_id), "rank": 1, "decoded_token": token_text(token_id)}
        entries.append({str(token_id): entry})
    return entries
