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
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from slipstream.config.inference_deployment import SESSION_HEADER
from slipstream.inference.admin_token import admin_headers
from slipstream.inference.instance import INSTANCE_HEADER

log = logging.getLogger(__name__)


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
    """Async client of one vLLM OpenAI-compatible server, or of a vllm-router in front of several engines
    (`engine_urls`): generation goes to `base_url`, admin calls (pause, weight transfer, resume, world size, and the
    probe check through `admin_clients`) to every engine directly. Use as `async with InferenceClient(...) as c`.

    Behind a router, `instance` is the engines' instance ids joined by commas: a reply through the router from any
    other start of an engine means that engine restarted."""

    def __init__(
        self, base_url: str, model_name: str, request_timeout_s: float, engine_urls: Sequence[str] = ()
    ) -> None:
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
        urls = [u.rstrip("/") for u in engine_urls]
        self.engines: list[InferenceClient] = (
            [] if urls in ([], [self.base_url]) else [InferenceClient(u, model_name, request_timeout_s) for u in urls]
        )
        """One client per engine behind the router (empty: base_url is the one engine)."""
        for engine in self.engines:
            engine.on_unavailable = self._engine_lost
        self._world_sizes: list[int] = []

    @property
    def admin_clients(self) -> "list[InferenceClient]":
        """The clients admin calls go to: every engine behind the router, else this one."""
        return self.engines or [self]

    def _engine_lost(self, error: InferenceUnavailable) -> None:
        if self.unavailable_reason is None:
            self.unavailable_reason = str(error)
        self.on_unavailable(error)

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None

    def mark_available(self) -> None:
        """The served weights are re-established on the server: generation requests may go out again."""
        self.unavailable_reason = None
        for engine in self.engines:
            engine.unavailable_reason = None

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
            if self.instance is None and not self.engines:  # behind a router, wait_healthy adopts every engine's
                self.instance = got
            return
        if got not in expected.split(","):
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
        for engine in self.engines:
            await engine.__aexit__(*exc)
        await self._http.aclose()

    async def post(
        self,
        path: str,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        text_reply: bool = False,
    ) -> Any:
        """POST and return the decoded JSON body (None for an empty body), or with `text_reply` the body's text;
        errors name the call and the reply."""
        where, expected = f"POST {self.base_url}{path}", self.instance
        try:
            response = await self._http.post(path, json=json, params=params, headers=headers)
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
        if text_reply:
            return response.text
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
        doubling). TimeoutError says which server was awaited, the last answer, and `hint` (what to check).
        Behind a router: the router, then every engine (each adopts the instance that answers); returns their ids
        joined by commas."""
        if self.engines:
            return await self._wait_engines_healthy(timeout_s, poll_s, max_poll_s, hint)
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

    async def _wait_engines_healthy(
        self, timeout_s: float, poll_s: float, max_poll_s: float | None, hint: str | None
    ) -> str | None:
        deadline = time.monotonic() + timeout_s
        router = InferenceClient(self.base_url, self.model_name, self.request_timeout_s)
        async with router:
            await router.wait_healthy(timeout_s, poll_s, max_poll_s, hint)
        instances = []
        for engine in self.engines:
            engine.instance = None  # a restarted engine is adopted anew
            left = max(0.1, deadline - time.monotonic())
            instances.append(await engine.wait_healthy(left, poll_s, max_poll_s, hint))
        self.instance = None if None in instances else ",".join(str(i) for i in instances)
        return self.instance

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

    async def chat(
        self,
        messages: list[dict[str, Any]],
        sampling: Mapping[str, Any],
        n: int,
        cache_salt: str,
        session: str | None = None,
    ) -> dict:
        """One non-streamed chat completion (token-in/token-out); the reply arrives whole when all samples end.
        `session` (one per rollout): the router sends every request of a session to the same engine."""
        self._require_available(f"POST {self.base_url}/v1/chat/completions")
        body = self.chat_body(messages, sampling, n, cache_salt)
        return await self.post("/v1/chat/completions", json=body, headers=_session_headers(session))

    async def stream_chat(
        self,
        messages: list[dict[str, Any]],
        sampling: Mapping[str, Any],
        n: int,
        cache_salt: str,
        session: str | None = None,
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
            headers = _session_headers(session)
            async with self._http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
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
        """Inference workers of the server across data-parallel replicas (vLLM's /get_world_size); behind a router,
        the sum over the engines (each joins a weight broadcast at its own rank offset)."""
        if self.engines:
            self._world_sizes = list(await asyncio.gather(*(e.get_world_size() for e in self.engines)))
            return sum(self._world_sizes)
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
        engines = self.admin_clients
        try:
            await asyncio.gather(*(e.post("/pause", params={"mode": "keep", "clear_cache": "false"}) for e in engines))
            if on_paused is not None:
                on_paused()
            resets = await asyncio.gather(
                *(
                    e._load_paused(version, update_info, self._engine_init_info(init_info, i))
                    for i, e in enumerate(engines)
                )
            )
            if before_resume is not None:
                before_resume()
        finally:
            results = await asyncio.gather(*(e.post("/resume") for e in engines), return_exceptions=True)
            if errors := [r for r in results if isinstance(r, BaseException)]:
                raise errors[0]
        return WeightLoad(seconds=time.perf_counter() - start, prefix_cache_reset=all(resets))

    async def load_lora_adapter(
        self, name: str, path: str, before_resume: Callable[[], None] | None = None
    ) -> WeightLoad:
        """Serve the LoRA adapter folder `path` as model `name` (`--enable-lora`), replacing the adapter of that name
        in place, with in-flight requests frozen: /pause (keep), /v1/load_lora_adapter (load_inplace),
        /reset_prefix_cache, `before_resume` (only if all succeeded), /resume. From then on requests name `name`."""
        start = time.perf_counter()
        engines = self.admin_clients
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        try:
            await asyncio.gather(*(e.post("/pause", params={"mode": "keep", "clear_cache": "false"}) for e in engines))
            await asyncio.gather(*(e.post("/v1/load_lora_adapter", json=body, text_reply=True) for e in engines))
            resets = await asyncio.gather(*(e.post("/reset_prefix_cache") for e in engines))
            for client in (self, *self.engines):
                client.model_name = name
            if before_resume is not None:
                before_resume()
        finally:
            results = await asyncio.gather(*(e.post("/resume") for e in engines), return_exceptions=True)
            if errors := [r for r in results if isinstance(r, BaseException)]:
                raise errors[0]
        reset = all(bool((r or {}).get("success", False)) if isinstance(r, dict) else False for r in resets)
        return WeightLoad(seconds=time.perf_counter() - start, prefix_cache_reset=reset)

    async def _load_paused(self, version: int, update_info: dict[str, Any], init_info: dict[str, Any] | None) -> bool:
        """The load itself on one paused engine; whether its prefix cache was reset."""
        if init_info is not None:
            await self.post("/init_weight_transfer_engine", json={"init_info": init_info})
        await self._start_weight_update(version)
        await self.post("/update_weights", json={"update_info": update_info})
        await self.post("/finish_weight_update", json={"weight_version": str(version)})
        reset = await self.post("/reset_prefix_cache")
        return bool((reset or {}).get("success", False))

    def _engine_init_info(self, init_info: dict[str, Any] | None, index: int) -> dict[str, Any] | None:
        """A broadcast session's init_info for engine `index`: its ranks follow those of the engines before it."""
        if init_info is None or not self.engines:
            return init_info
        if len(self._world_sizes) != len(self.engines):
            raise InferenceError("get_world_size() must precede a weight broadcast to several engines")
        return {**init_info, "rank_offset": init_info.get("rank_offset", 1) + sum(self._world_sizes[:index])}

    async def _start_weight_update(self, version: int) -> None:
        """/start_weight_update; a session left open by a dead orchestrator is closed first (its partial weights,
        served by no request while paused, are all overwritten by this load), else resume could never load."""
        try:
            await self.post("/start_weight_update")
        except WeightUpdateOpen as e:
            log.warning(f"closing a weight update an earlier orchestrator left open ({e})")
            await self.post("/finish_weight_update", json={"weight_version": str(version)})
            await self.post("/start_weight_update")


def _session_headers(session: str | None) -> dict[str, str] | None:
    return None if session is None else {SESSION_HEADER: session}


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
