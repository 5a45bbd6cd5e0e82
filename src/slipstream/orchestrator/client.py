"""HTTP client of the vLLM server: health, chat rollouts (streamed or whole), prompt scoring, /metrics and the
weight updates through vLLM's weight-transfer API.

Weight updates need the server started with VLLM_SERVER_DEV_MODE=1 (`/pause`, the weight-transfer routes, ...)
and `--weight-transfer-config '{"backend": "slipstream"}'` (inference/transfer_engine.py).
Cancelling a streamed request closes its connection, and vLLM aborts a request whose client disconnected.

Losing the server (connection refused or dropped, HTTP 5xx, or a reply from another start of the server than the
one the weights were loaded on: `X-Slipstream-Instance`) raises InferenceUnavailable and marks the client
unavailable: from then on it sends no generation request until the weight relay has re-established the served
weights on the server (weights.py) and calls `mark_available()`.
"""

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from slipstream.inference.admin_token import admin_headers
from slipstream.inference.instance import INSTANCE_HEADER


class InferenceError(RuntimeError):
    """The inference server answered with an error or with a response Slipstream cannot use."""


class InferenceUnavailable(InferenceError):
    """The server could not be reached, dropped the connection, answered HTTP 5xx, or restarted (it lost the loaded
    weights): wait until it is back and re-establish the served weights before sending new requests."""


class WeightUpdateOpen(InferenceError):
    """/start_weight_update refused: the server has a weight update open, left by an orchestrator that died between
    /start_weight_update and /finish_weight_update on a server that outlived it (another node, an external server).
    vLLM answers HTTP 500 (its worker's RuntimeError), the simulator 400: told apart by vLLM's message."""


_WEIGHT_UPDATE_OPEN = "weight update is already active"

_UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""Transport errors that mean the server is gone (a read timeout is not one: the server may just be slow)."""


class ContextLengthError(InferenceError):
    """The server refused a request whose prompt leaves no room in the model's context window (HTTP 400)."""


_CONTEXT_LENGTH_RE = re.compile(r"maximum context length|maximum model length", re.IGNORECASE)
"""vLLM 0.32's wordings of a prompt too long for max_model_len (renderers/params.py, v1/engine/input_processor.py)."""


def request_error(where: str, status: int, text: str) -> InferenceError:
    """The error of a refused request: ContextLengthError for a prompt that fills the context, hints for known
    misconfigurations, InferenceError otherwise."""
    message = f"POST {where} returned HTTP {status}: {text[:1000]}"
    if status == 400 and _CONTEXT_LENGTH_RE.search(text):
        return ContextLengthError(message)
    if "--enable-auto-tool-choice" in text:
        message += "; the environment offers tools: set inference.tool_call_parser (e.g. 'hermes')"
    return InferenceError(message)


@dataclass(frozen=True)
class WeightLoad:
    """Outcome of one in-place weight load."""

    seconds: float
    """Wall time from the pause to the resume."""
    prefix_cache_reset: bool
    """Whether /reset_prefix_cache freed the cache. vLLM refuses while requests hold blocks (always the case
    with requests in flight); correctness does not depend on it, new requests carry a per-version cache_salt."""


class InferenceClient:
    """Async client of one vLLM OpenAI-compatible server. Use as `async with InferenceClient(...) as client`."""

    def __init__(self, base_url: str, model_name: str, request_timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=request_timeout_s, limits=limits, headers=admin_headers()
        )
        self.instance: str | None = None
        """The server start (`X-Slipstream-Instance`) the served weights are on; adopted at first contact."""
        self.unavailable_reason: str | None = None
        """Why the server was lost; None while it is available. Generation requests are refused while set."""
        self.on_unavailable: Callable[[InferenceUnavailable], None] = lambda error: None
        """Called whenever a call finds the server unavailable (the weight relay starts its recovery)."""

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None

    def mark_available(self) -> None:
        """The served weights are re-established on the server: generation requests may go out again."""
        self.unavailable_reason = None

    def _unavailable(self, message: str) -> InferenceUnavailable:
        """Record that the server is lost (the first reason is kept) and return the error to raise."""
        error = InferenceUnavailable(message)
        if self.unavailable_reason is None:
            self.unavailable_reason = message
        self.on_unavailable(error)
        return error

    def _check_instance(self, response: httpx.Response, expected: str | None, where: str) -> None:
        """Raise InferenceUnavailable if the reply comes from another start of the server than `expected` (the
        instance when the request was sent)."""
        got = response.headers.get(INSTANCE_HEADER)
        if got is None:
            return  # a server without the header (not started by `slipstream inference`): no restart detection
        if expected is None:
            if self.instance is None:
                self.instance = got
            return
        if got != expected:
            raise self._unavailable(
                f"{where} was answered by inference instance {got}, not {expected} which holds the served weights: "
                "the server restarted"
            )

    def _require_available(self, where: str) -> None:
        if self.unavailable_reason is not None:
            raise self._unavailable(
                f"{where} not sent: inference is unavailable ({self.unavailable_reason}) until the served weights "
                "are re-established"
            )

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def post(self, path: str, json: Any = None, params: Mapping[str, str] | None = None) -> Any:
        """POST and return the decoded JSON body (None for an empty body); errors name the call and the reply."""
        where, expected = f"POST {self.base_url}{path}", self.instance
        try:
            response = await self._http.post(path, json=json, params=params)
        except _UNREACHABLE as e:
            raise self._unavailable(f"{where} failed: {type(e).__name__}: {e}") from e
        except httpx.HTTPError as e:
            raise InferenceError(f"{where} failed: {type(e).__name__}: {e}") from e
        self._check_instance(response, expected, where)
        if response.status_code != 200 and path == "/start_weight_update" and _WEIGHT_UPDATE_OPEN in response.text:
            raise WeightUpdateOpen(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code >= 500:
            raise self._unavailable(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code != 200:
            raise request_error(f"{self.base_url}{path}", response.status_code, response.text)
        return _json_reply(response, where) if response.content else None

    async def get_text(self, path: str) -> str:
        """GET a text resource (e.g. /metrics); errors name the call and the reply."""
        where, expected = f"GET {self.base_url}{path}", self.instance
        try:
            response = await self._http.get(path)
        except _UNREACHABLE as e:
            raise self._unavailable(f"{where} failed: {type(e).__name__}: {e}") from e
        except httpx.HTTPError as e:
            raise InferenceError(f"{where} failed: {type(e).__name__}: {e}") from e
        self._check_instance(response, expected, where)
        if response.status_code >= 500:
            raise self._unavailable(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code != 200:
            raise InferenceError(
                f"GET {self.base_url}{path} returned HTTP {response.status_code}: {response.text[:500]}"
            )
        return response.text

    async def wait_healthy(
        self, timeout_s: float, poll_s: float = 0.5, max_poll_s: float | None = None, hint: str | None = None
    ) -> str | None:
        """Block until GET /health answers 200 and return the answering server's instance id (None if it sends
        none); the first contact adopts it. Polls every `poll_s`, doubling up to `max_poll_s` (default: no
        doubling). TimeoutError says which server was awaited, the last answer, and `hint` (what to check)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        delay = poll_s
        while True:
            try:
                response = await self._http.get("/health", timeout=min(10.0, timeout_s))
                if response.status_code == 200:
                    instance = response.headers.get(INSTANCE_HEADER)
                    if self.instance is None:
                        self.instance = instance
                    return instance
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                hint = hint or "is it running, and is orchestrator.inference_url right?"
                raise TimeoutError(
                    f"waited {timeout_s:.0f}s for the inference server at {self.base_url}/health (last: {last}); {hint}"
                )
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic()) + 0.01))
            delay = min(delay * 2, max_poll_s) if max_poll_s is not None else delay

    def chat_body(self, messages: list[dict[str, Any]], sampling: Mapping[str, Any], n: int, cache_salt: str) -> dict:
        """Body of a chat completion with `n` samples returning token ids and per-token logprobs."""
        return {
            "model": self.model_name,
            "messages": messages,
            "n": n,
            **sampling,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            "cache_salt": cache_salt,
        }

    async def chat(self, messages: list[dict[str, Any]], sampling: Mapping[str, Any], n: int, cache_salt: str) -> dict:
        """One non-streamed chat completion (token-in/token-out); the reply arrives whole when all samples end."""
        self._require_available(f"POST {self.base_url}/v1/chat/completions")
        return await self.post("/v1/chat/completions", json=self.chat_body(messages, sampling, n, cache_salt))

    async def stream_chat(
        self, messages: list[dict[str, Any]], sampling: Mapping[str, Any], n: int, cache_salt: str
    ) -> AsyncIterator[dict]:
        """One streamed chat completion: yields each decoded `data:` chunk as it arrives, ending at `[DONE]`.

        An error chunk (`{"error": ...}`) raises. Callers bound the whole stream (httpx bounds each read).
        """
        body = self.chat_body(messages, sampling, n, cache_salt)
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        where = f"{self.base_url}/v1/chat/completions (stream)"
        self._require_available(f"POST {where}")
        expected = self.instance
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                self._check_instance(response, expected, f"POST {where}")
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    if response.status_code >= 500:
                        raise self._unavailable(f"POST {where} returned HTTP {response.status_code}: {text[:500]}")
                    raise request_error(where, response.status_code, text)
                async for chunk in _sse_chunks(response, where):
                    yield chunk
        except _ServerErrorChunk as e:
            raise self._unavailable(str(e)) from None
        except _UNREACHABLE as e:
            raise self._unavailable(f"POST {where} failed: {type(e).__name__}: {e}") from e
        except httpx.HTTPError as e:
            raise InferenceError(f"POST {where} failed: {type(e).__name__}: {e}") from e

    async def score_tokens(self, token_ids: list[int], cache_salt: str) -> list[float]:
        """Log-prob of each token given its prefix at temperature 1: entry i scores token_ids[i + 1]."""
        body = {
            "model": self.model_name,
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
            "cache_salt": cache_salt,
        }
        reply = await self.post("/v1/completions", json=body)
        return parse_prompt_logprobs(reply, token_ids, f"{self.base_url}/v1/completions")

    async def get_world_size(self) -> int:
        """Inference workers of the server across data-parallel replicas (vLLM's /get_world_size)."""
        where, expected = f"GET {self.base_url}/get_world_size", self.instance
        try:
            response = await self._http.get("/get_world_size", params={"include_dp": "true"})
        except _UNREACHABLE as e:
            raise self._unavailable(f"{where} failed: {type(e).__name__}: {e}") from e
        self._check_instance(response, expected, where)
        if response.status_code >= 500:
            raise self._unavailable(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code != 200:
            raise InferenceError(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        reply = _json_reply(response, where)
        world_size = reply.get("world_size") if isinstance(reply, dict) else None
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise InferenceError(f"{where}: reply has no integer world_size >= 1: {response.text[:300]}")
        return world_size

    async def load_weights(
        self,
        version: int,
        update_info: dict[str, Any],
        init_info: dict[str, Any] | None = None,
        on_paused: Callable[[], None] | None = None,
        before_resume: Callable[[], None] | None = None,
    ) -> WeightLoad:
        """Load weight version `version` through vLLM's weight-transfer API, with in-flight requests frozen:
        /pause (keep), `on_paused`, /init_weight_transfer_engine (when `init_info`: a new transfer session),
        /start_weight_update, /update_weights (`update_info`: a folder or a broadcast's manifest),
        /finish_weight_update (weight version), /reset_prefix_cache, `before_resume` (only if all succeeded), /resume.

        `clear_cache=false`: vLLM 0.32 would otherwise preempt every running request at the pause (its cache
        reset moves them to the waiting queue) and recompute their KV at resume, a restart of their prefill that
        also counts as preemptions. With it, in-flight requests keep their KV and continue where they were.
        """
        start = time.perf_counter()
        await self.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        try:
            if on_paused is not None:
                on_paused()
            if init_info is not None:
                await self.post("/init_weight_transfer_engine", json={"init_info": init_info})
            await self._start_weight_update(version)
            await self.post("/update_weights", json={"update_info": update_info})
            await self.post("/finish_weight_update", json={"weight_version": str(version)})
            reset = await self.post("/reset_prefix_cache")
            if before_resume is not None:
                before_resume()
        finally:
            await self.post("/resume")
        return WeightLoad(
            seconds=time.perf_counter() - start, prefix_cache_reset=bool((reset or {}).get("success", False))
        )

    async def _start_weight_update(self, version: int) -> None:
        """/start_weight_update; a session left open by a dead orchestrator is closed first (its partial weights,
        served by no request while paused, are all overwritten by this load), else resume could never load."""
        try:
            await self.post("/start_weight_update")
        except WeightUpdateOpen as e:
            print(f"[orchestrator] closing a weight update an earlier orchestrator left open ({e})", flush=True)
            await self.post("/finish_weight_update", json={"weight_version": str(version)})
            await self.post("/start_weight_update")


def _json_reply(response: httpx.Response, where: str) -> Any:
    try:
        return response.json()
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep
        raise InferenceError(f"{where}: the reply is not JSON ({e}): {response.text[:300]!r}") from e


class _ServerErrorChunk(InferenceError):
    """A mid-stream error chunk with a 5xx code (the stream's client turns it into InferenceUnavailable)."""


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The body's lines as server-sent events define them (ended by \\n, \\r\\n or \\r). Not httpx's aiter_lines:
    it also splits on Unicode line separators (U+2028, U+0085, ...) that JSON leaves unescaped inside strings, which
    cuts a chunk whose generated text holds one."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *lines, buffer = buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for line in lines:
            yield line
    if buffer:
        yield buffer


async def _sse_chunks(response: httpx.Response, where: str) -> AsyncIterator[dict]:
    """Decode a server-sent-event body of `data: <json>` lines until `data: [DONE]`."""
    async for line in _sse_lines(response):
        if not line.startswith("data:"):
            continue  # blank separators (and comments) between events
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise InferenceError(f"{where}: undecodable stream chunk {data[:300]!r}") from e
        if not isinstance(chunk, dict):
            raise InferenceError(f"{where}: stream chunk is not a JSON object: {data[:300]!r}")
        if "error" in chunk:
            error = chunk["error"]
            code = error.get("code") if isinstance(error, dict) else None
            kind = _ServerErrorChunk if isinstance(code, int) and code >= 500 else InferenceError
            raise kind(f"{where}: the server reported an error mid-stream: {error}")
        yield chunk
    raise InferenceError(f"{where}: the stream ended without its final `data: [DONE]`")


def parse_prompt_logprobs(reply: dict, token_ids: list[int], where: str) -> list[float]:
    """Pick, from a completions reply with `prompt_logprobs`, the log-prob of each actual prompt token after the first."""
    try:
        entries = reply["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError) as e:
        raise InferenceError(f"{where}: reply has no choices[0].prompt_logprobs: {str(reply)[:500]}") from e
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        got = len(entries) if isinstance(entries, list) else repr(entries)[:100]
        raise InferenceError(f"{where}: {got} prompt_logprobs entries for a prompt of {len(token_ids)} tokens")
    logprobs = []
    for i in range(1, len(token_ids)):
        entry = entries[i] or {}
        picked = entry.get(str(token_ids[i])) if isinstance(entry, dict) else None
        if picked is None:
            raise InferenceError(f"{where}: prompt_logprobs[{i}] lacks the prompt token {token_ids[i]}: {entry!r:.300}")
        logprob = picked.get("logprob") if isinstance(picked, dict) else None
        if not isinstance(logprob, int | float) or isinstance(logprob, bool) or not math.isfinite(logprob):
            raise InferenceError(f"{where}: prompt_logprobs[{i}] has no finite 'logprob': {picked!r:.300}")
        logprobs.append(float(logprob))
    return logprobs
