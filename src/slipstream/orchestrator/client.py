"""HTTP client of the vLLM server: health, chat rollouts (streamed or whole), prompt scoring, /metrics and the
dev-mode weight-update calls.

Weight updates need the server started with VLLM_SERVER_DEV_MODE=1 (`/pause`, `/collective_rpc`, ...).
Cancelling a streamed request closes its connection, and vLLM aborts a request whose client disconnected.
"""

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from slipstream.inference.admin_token import admin_headers

LOAD_WEIGHTS_METHOD = "slipstream_load_weights"
"""Worker-extension method that loads a published `weights/step_N` directory in place."""


class InferenceError(RuntimeError):
    """The inference server answered with an error or with a response Slipstream cannot use."""


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

    results: list[Any]
    """The worker extension's results, one per worker."""
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

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def post(self, path: str, json: Any = None, params: Mapping[str, str] | None = None) -> Any:
        """POST and return the decoded JSON body (None for an empty body); errors name the call and the reply."""
        try:
            response = await self._http.post(path, json=json, params=params)
        except httpx.HTTPError as e:
            raise InferenceError(f"POST {self.base_url}{path} failed: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise request_error(f"{self.base_url}{path}", response.status_code, response.text)
        return response.json() if response.content else None

    async def get_text(self, path: str) -> str:
        """GET a text resource (e.g. /metrics); errors name the call and the reply."""
        try:
            response = await self._http.get(path)
        except httpx.HTTPError as e:
            raise InferenceError(f"GET {self.base_url}{path} failed: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise InferenceError(
                f"GET {self.base_url}{path} returned HTTP {response.status_code}: {response.text[:500]}"
            )
        return response.text

    async def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Block until GET /health answers 200; TimeoutError says which server was awaited."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            try:
                response = await self._http.get("/health", timeout=min(10.0, timeout_s))
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {timeout_s:.0f}s for the inference server at {self.base_url}/health (last: {last}); "
                    "is it running, and is orchestrator.inference_url right?"
                )
            await asyncio.sleep(poll_s)

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
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise request_error(where, response.status_code, text)
                async for chunk in _sse_chunks(response, where):
                    yield chunk
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

    async def load_weights(self, weights_path: str, before_resume: Callable[[], None] | None = None) -> WeightLoad:
        """Pause keeping in-flight requests (their decode freezes), load `weights_path` on every worker, drop the
        prefix cache, call `before_resume` (it runs only if the load succeeded), resume.

        `clear_cache=false`: vLLM 0.32 would otherwise preempt every running request at the pause (its cache
        reset moves them to the waiting queue) and recompute their KV at resume, a restart of their prefill that
        also counts as preemptions. With it, in-flight requests keep their KV and continue where they were.
        """
        await self.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        try:
            reply = await self.post("/collective_rpc", json={"method": LOAD_WEIGHTS_METHOD, "args": [weights_path]})
            results = (reply or {}).get("results")
            if not results:
                raise InferenceError(
                    f"/collective_rpc {LOAD_WEIGHTS_METHOD}({weights_path}) returned no worker results: {reply!r}; "
                    "is the server started with Slipstream's worker extension?"
                )
            reset = await self.post("/reset_prefix_cache")
            if before_resume is not None:
                before_resume()
        finally:
            await self.post("/resume")
        return WeightLoad(results=results, prefix_cache_reset=bool((reset or {}).get("success", False)))


async def _sse_chunks(response: httpx.Response, where: str) -> AsyncIterator[dict]:
    """Decode a server-sent-event body of `data: <json>` lines until `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators (and comments) between events
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as e:
            raise InferenceError(f"{where}: undecodable stream chunk {data[:300]!r}") from e
        if "error" in chunk:
            raise InferenceError(f"{where}: the server reported an error mid-stream: {chunk['error']}")
        yield chunk
    raise InferenceError(f"{where}: the stream ended without its final `data: [DONE]`")


def parse_prompt_logprobs(reply: dict, token_ids: list[int], where: str) -> list[float]:
    """Pick, from a completions reply with `prompt_logprobs`, the log-prob of each actual prompt token after the first."""
    try:
        entries = reply["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError) as e:
        raise InferenceError(f"{where}: reply has no choices[0].prompt_logprobs: {str(reply)[:500]}") from e
    if entries is None or len(entries) != len(token_ids):
        got = None if entries is None else len(entries)
        raise InferenceError(f"{where}: {got} prompt_logprobs entries for a prompt of {len(token_ids)} tokens")
    logprobs = []
    for i in range(1, len(token_ids)):
        entry = entries[i] or {}
        picked = entry.get(str(token_ids[i]))
        if picked is None:
            raise InferenceError(f"{where}: prompt_logprobs[{i}] lacks the prompt token {token_ids[i]}: {entry!r}")
        logprobs.append(float(picked["logprob"]))
    return logprobs
