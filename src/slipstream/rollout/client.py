"""HTTP client of the vLLM server's generation side, the token-in/token-out requests of rollouts: chat completions
(streamed or whole) returning token ids and per-token logprobs, and prompt scoring. The admin calls (health, world
size, weight loads) extend it in orchestrator/client.py.

Cancelling a streamed request closes its connection, and vLLM aborts a request whose client disconnected.

Losing the server (connection refused or dropped, HTTP 5xx, or a reply from another start of the server than the
one the weights were loaded on: `X-Slipstream-Instance`) raises InferenceUnavailable and marks the client
unavailable: from then on it sends no generation request until the weight relay has re-established the served
weights on the server (orchestrator/weights.py) and calls `mark_available()`.
"""

import asyncio
import json
import math
import re
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx

from slipstream.config.inference_deployment import SESSION_HEADER
from slipstream.inference.admin_token import HANDLED_MS_HEADER, LOOP_LAG_MS_HEADER, PAUSED_MS_HEADER, admin_headers
from slipstream.inference.instance import INSTANCE_HEADER


class InferenceError(RuntimeError):
    """The inference server answered with an error or with a response Slipstream cannot use."""


class InferenceUnavailable(InferenceError):
    """The server could not be reached, dropped the connection, answered HTTP 5xx, or restarted (it lost the loaded
    weights): wait until it is back and re-establish the served weights before sending new requests."""


UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
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
class ServerTiming:
    """An admin reply's diagnostics: the server's own seconds on the call, and its event loop's worst lateness since
    the admin call before (None where a header is missing or unreadable: diagnostics never fail a call)."""

    handled_s: float | None
    loop_lag_s: float | None
    paused_s: float | None = None
    """/resume's reply: the engine's pause, from the /pause request's arrival at the server to this reply."""

    @classmethod
    def from_headers(cls, headers: httpx.Headers) -> "ServerTiming":
        def seconds(header: str) -> float | None:
            try:
                return float(headers[header]) / 1e3
            except (KeyError, ValueError):
                return None

        return cls(seconds(HANDLED_MS_HEADER), seconds(LOOP_LAG_MS_HEADER), seconds(PAUSED_MS_HEADER))


class GenerationClient:
    """Async client of the generation side of one vLLM OpenAI-compatible server (or of a vllm-router in front of
    several engines). Use as `async with client:`."""

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
        self.server_timing: dict[str, ServerTiming] = {}
        """Path -> what the server said of the last admin call to it (inference/auth.py's reply headers)."""
        self.salt_scope = secrets.token_hex(6)
        """Prefix of every request's cache_salt, new at each start of a client: a server's cached KV is reused only
        by requests of the client start that cached it, never by another run sharing the server (LoRA tenants) or a
        restart of this one, whose versions of the same number may hold other weights. No prefix-cache reset is
        needed for that (vLLM refuses one while other clients' requests hold blocks)."""

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
            if self.instance is None and self._adopts_instance():
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

    def _adopts_instance(self) -> bool:
        """Whether a reply's instance is adopted at first contact (behind a router, wait_healthy adopts every
        engine's instead)."""
        return True

    def _check_refusal(self, path: str, response: httpx.Response, where: str) -> None:
        """Raise the error of a refusal told apart from a lost server (before the HTTP 5xx check); none here."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def post(
        self,
        path: str,
        json: Any = None,
        params: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
        headers: Mapping[str, str] | None = None,
        text_reply: bool = False,
    ) -> Any:
        """POST and return the decoded JSON body (None for an empty body), or with `text_reply` the body's text;
        errors name the call and the reply."""
        where, expected = f"POST {self.base_url}{path}", self.instance
        try:
            response = await self._http.post(path, json=json, params=params, headers=headers)
        except UNREACHABLE as e:
            raise self._unavailable(f"{where} failed: {type(e).__name__}: {e}") from e
        except httpx.HTTPError as e:
            raise InferenceError(f"{where} failed: {type(e).__name__}: {e}") from e
        self._check_instance(response, expected, where)
        self._check_refusal(path, response, where)
        if HANDLED_MS_HEADER in response.headers:
            self.server_timing[path] = ServerTiming.from_headers(response.headers)
        if response.status_code >= 500:
            raise self._unavailable(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code != 200:
            raise request_error(f"{self.base_url}{path}", response.status_code, response.text)
        if text_reply:
            return response.text
        return json_reply(response, where) if response.content else None

    def scoped_salt(self, cache_salt: str) -> str:
        """The cache_salt a request carries: `cache_salt` (a policy version's) within this client start's scope."""
        return f"{self.salt_scope}:{cache_salt}"

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
            "cache_salt": self.scoped_salt(cache_salt),
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
        except UNREACHABLE as e:
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
            "cache_salt": self.scoped_salt(cache_salt),
        }
        reply = await self.post("/v1/completions", json=body)
        return parse_prompt_logprobs(reply, token_ids, f"{self.base_url}/v1/completions")

    async def score_tokens_per_position(self, token_ids: list[int], cache_salt: str) -> list[float]:
        """What score_tokens returns, computed without `prompt_logprobs`: one single-token request per position
        (prompt token_ids[: i + 1]) asking, through `logprob_token_ids`, for the log-prob of token_ids[i + 1] at the
        position it generates (temperature 1, no other sampling parameter: the processed log-probs the server
        reports are the model's own). For LoRA adapters: vLLM computes the prompt log-probs of a LoRA request with
        the per-request adapter mapping of the whole batch, so when other requests share the step the engine dies
        (CPU build: an einsum shape error; vLLM issues 16668 and 29955) or the adapter's LM-head delta is dropped
        (issue 51594); a generated position takes the mapping sampling uses, which is right. The requests share their
        prefix (prefix caching, same cache_salt)."""
        where = f"{self.base_url}/v1/completions"

        async def one(position: int) -> float:
            body = {
                "model": self.model_name,
                "prompt": token_ids[:position],
                "max_tokens": 1,
                "temperature": 1.0,
                "logprobs": 1,
                "logprob_token_ids": [token_ids[position]],
                "return_tokens_as_token_ids": True,
                "cache_salt": self.scoped_salt(cache_salt),
            }
            reply = await self.post("/v1/completions", json=body)
            return parse_token_logprob(reply, token_ids[position], f"{where} (position {position})")

        return list(await asyncio.gather(*(one(i) for i in range(1, len(token_ids)))))


def _session_headers(session: str | None) -> dict[str, str] | None:
    return None if session is None else {SESSION_HEADER: session}


def json_reply(response: httpx.Response, where: str) -> Any:
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


def parse_token_logprob(reply: dict, token_id: int, where: str) -> float:
    """The log-prob of `token_id` at the one generated position of a completions reply that asked for it through
    `logprob_token_ids` (with `return_tokens_as_token_ids`: entries are keyed "token_id:<id>")."""
    key = f"token_id:{token_id}"
    try:
        entry = reply["choices"][0]["logprobs"]["top_logprobs"][0]
    except (KeyError, IndexError, TypeError) as e:
        raise InferenceError(f"{where}: reply has no choices[0].logprobs.top_logprobs[0]: {str(reply)[:500]}") from e
    value = entry.get(key) if isinstance(entry, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InferenceError(
            f"{where}: top_logprobs[0] has no finite {key!r} ({entry!r:.300}): the server ignores logprob_token_ids "
            "(vLLM 0.32 or later has it)"
        )
    return float(value)


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
