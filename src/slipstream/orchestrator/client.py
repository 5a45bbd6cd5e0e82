"""Admin side of the vLLM server's HTTP client: health, world size, and the weight updates through vLLM's
weight-transfer API, sent to every engine behind a router. Generation requests and the detection of a lost server
are rollout/client.py's GenerationClient, which InferenceClient extends.

Weight updates need the server started with VLLM_SERVER_DEV_MODE=1 (`/pause`, the weight-transfer routes, ...)
and `--weight-transfer-config '{"backend": "slipstream"}'` (weights/receive/engine.py).
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from slipstream.inference.instance import INSTANCE_HEADER
from slipstream.rollout.client import (
    UNREACHABLE,
    GenerationClient,
    InferenceError,
    InferenceUnavailable,
    json_reply,
)
from slipstream.weights.wire.published import INCOMPLETE_MARKER, STAGING_FAILED

log = logging.getLogger(__name__)


class WeightUpdateOpen(InferenceError):
    """/start_weight_update refused: the server has a weight update open, left by an orchestrator that died between
    /start_weight_update and /finish_weight_update on a server that outlived it (another node, an external server).
    vLLM answers HTTP 500 (its worker's RuntimeError), the simulator 400: told apart by vLLM's message."""


_WEIGHT_UPDATE_OPEN = "weight update is already active"
_LOADS = ("/update_weights", "/finish_weight_update")
"""Where the engine loads a version: /update_weights (paused), /finish_weight_update (the swap of a no-stall update)."""


class WeightUpdateIncomplete(InferenceError):
    """/update_weights refused: the engine received the version but some of its tensors never reached the model
    (weights/receive/receiver.check_loaded); vLLM answers HTTP 500 with the engine's message. Not a lost server."""


class WeightStagingFailed(InferenceError):
    """A no-stall update (`weights.no_stall`) could not stage its version (weights/receive/staging.py: no memory for
    it, or its receive failed); /update_weights or /finish_weight_update answer HTTP 500 with the engine's message.
    The model still serves the version before, whole. Not a lost server."""


@dataclass(frozen=True)
class WeightLoad:
    """Outcome of one in-place weight load."""

    seconds: float
    """Wall time from the pause to the resume (a staged update: the swap, see `staged`)."""
    prefix_cache_reset: bool
    """Whether /reset_prefix_cache freed the cache. vLLM refuses while requests hold blocks (always the case
    with requests in flight); correctness does not depend on it, new requests carry a per-version cache_salt."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each admin call of the load (`pause`, `init`, `start`, `transfer`, `finish`, `reset`, `resume`;
    with several engines the slowest engine's), so a slow update says where its time went; `<call>_server`: the part
    the server itself spent on it (the rest is the way there and back, both event loops included);
    `server_loop_lag`: the server's event loop, its worst lateness since the update before (while it streamed);
    `engine_paused`: the time vLLM's engine held its requests, from /pause's arrival at the server to /resume's reply
    (the slowest engine's): `seconds` less the way to the server and the wait of /pause in its event loop, during which
    vLLM still generates."""
    staged: bool = False
    """A no-stall update (load_weights_staged): `seconds` is the swap alone, the only time vLLM did not generate."""


class InferenceClient(GenerationClient):
    """Async client of one vLLM OpenAI-compatible server, or of a vllm-router in front of several engines
    (`engine_urls`): generation (GenerationClient's) goes to `base_url`, admin calls (pause, weight transfer, resume, world size, and the
    probe check through `admin_clients`) to every engine directly. Use as `async with InferenceClient(...) as c`.

    Behind a router, `instance` is the engines' instance ids joined by commas: a reply through the router from any
    other start of an engine means that engine restarted."""

    def __init__(
        self, base_url: str, model_name: str, request_timeout_s: float, engine_urls: Sequence[str] = ()
    ) -> None:
        super().__init__(base_url, model_name, request_timeout_s)
        urls = [u.rstrip("/") for u in engine_urls]
        self.engines: list[InferenceClient] = (
            [] if urls in ([], [self.base_url]) else [InferenceClient(u, model_name, request_timeout_s) for u in urls]
        )
        """One client per engine behind the router (empty: base_url is the one engine)."""
        for engine in self.engines:
            engine.on_unavailable = self._engine_lost
            engine.salt_scope = self.salt_scope  # the weight check's probes share the rollouts' scope
        self._world_sizes: list[int] = []

    @property
    def admin_clients(self) -> "list[InferenceClient]":
        """The clients admin calls go to: every engine behind the router, else this one."""
        return self.engines or [self]

    def _engine_lost(self, error: InferenceUnavailable) -> None:
        if self.unavailable_reason is None:
            self.unavailable_reason = str(error)
        self.on_unavailable(error)

    def mark_available(self) -> None:
        """The served weights are re-established on the server: generation requests may go out again."""
        super().mark_available()
        for engine in self.engines:
            engine.unavailable_reason = None

    def _adopts_instance(self) -> bool:
        return not self.engines

    def _check_refusal(self, path: str, response: httpx.Response, where: str) -> None:
        if response.status_code != 200 and path == "/start_weight_update" and _WEIGHT_UPDATE_OPEN in response.text:
            raise WeightUpdateOpen(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code != 200 and path in _LOADS and INCOMPLETE_MARKER in response.text:
            raise WeightUpdateIncomplete(f"{where} returned HTTP {response.status_code}: {response.text[:1000]}")
        if response.status_code != 200 and path in _LOADS and STAGING_FAILED in response.text:
            raise WeightStagingFailed(f"{where} returned HTTP {response.status_code}: {response.text[:1000]}")

    async def __aexit__(self, *exc: object) -> None:
        for engine in self.engines:
            await engine.__aexit__(*exc)
        await super().__aexit__(*exc)

    async def get_text(self, path: str) -> str:
        """GET a text resource (e.g. /metrics); errors name the call and the reply."""
        where, expected = f"GET {self.base_url}{path}", self.instance
        try:
            response = await self._http.get(path)
        except UNREACHABLE as e:
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

    async def get_world_size(self) -> int:
        """Inference workers of the server across data-parallel replicas (vLLM's /get_world_size); behind a router,
        the sum over the engines (each joins a weight broadcast at its own rank offset)."""
        if self.engines:
            self._world_sizes = list(await asyncio.gather(*(e.get_world_size() for e in self.engines)))
            return sum(self._world_sizes)
        reply = await self._get_json("/get_world_size", params={"include_dp": "true"})
        where = f"GET {self.base_url}/get_world_size"
        world_size = reply.get("world_size") if isinstance(reply, dict) else None
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise InferenceError(f"{where}: reply has no integer world_size >= 1: {str(reply)[:300]}")
        return world_size

    async def weight_versions(self) -> dict[str, str | None]:
        """Engine URL -> the weight version it serves (vLLM's /weight_info): "default" while it serves the weights it
        started with, else the `weight_version` of its last finished update; None where the server cannot tell (no
        /weight_info: HTTP 404)."""
        if self.engines:
            found = await asyncio.gather(*(e.weight_versions() for e in self.engines))
            return {url: version for versions in found for url, version in versions.items()}
        reply = await self._get_json("/weight_info", missing_ok=True)
        if reply is None:
            return {self.base_url: None}
        version = reply.get("weight_version") if isinstance(reply, dict) else None
        if not isinstance(version, str):
            raise InferenceError(f"GET {self.base_url}/weight_info: reply has no string weight_version: {reply!r:.300}")
        return {self.base_url: version}

    async def _get_json(self, path: str, params: dict[str, str] | None = None, missing_ok: bool = False) -> Any:
        """GET an admin route's JSON reply (None for HTTP 404 when `missing_ok`); a lost server raises
        InferenceUnavailable, another refusal InferenceError, both naming the call."""
        where, expected = f"GET {self.base_url}{path}", self.instance
        try:
            response = await self._http.get(path, params=params)
        except UNREACHABLE as e:
            raise self._unavailable(f"{where} failed: {type(e).__name__}: {e}") from e
        self._check_instance(response, expected, where)
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code >= 500:
            raise self._unavailable(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code != 200:
            raise InferenceError(f"{where} returned HTTP {response.status_code}: {response.text[:500]}")
        return json_reply(response, where)

    async def sleep(self, level: int) -> None:
        """Put every engine to sleep (vLLM's sleep mode; level 0 only pauses scheduling); requests still in flight
        finish first (mode `wait`)."""
        params = {"level": str(level), "mode": "wait"}
        await asyncio.gather(*(e.post("/sleep", params=params) for e in self.admin_clients))

    async def wake_up(self, tags: Sequence[str]) -> None:
        """Wake what `tags` names on every engine (`weights`, `kv_cache`; `scheduling` after level 0)."""
        params = [("tags", tag) for tag in tags]
        await asyncio.gather(*(e.post("/wake_up", params=params) for e in self.admin_clients))

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
        phases: dict[str, float] = {}
        failure: BaseException | None = None
        try:
            await asyncio.gather(*(e.post("/pause", params={"mode": "keep", "clear_cache": "false"}) for e in engines))
            phases["pause"] = time.perf_counter() - start
            timings = [t for e in engines if (t := e.server_timing.pop("/pause", None)) is not None]
            for phase, values in (
                ("pause_server", [t.handled_s for t in timings]),
                ("server_loop_lag", [t.loop_lag_s for t in timings]),  # the worst since the update before
            ):
                if known := [v for v in values if v is not None]:
                    phases[phase] = max(known)
            if on_paused is not None:
                accepted = time.perf_counter()
                on_paused()
                phases["on_paused"] = time.perf_counter() - accepted
            loads = await asyncio.gather(
                *(
                    e._load_paused(version, update_info, self._engine_init_info(init_info, i))
                    for i, e in enumerate(engines)
                )
            )
            for _, engine_phases in loads:
                for name, seconds in engine_phases.items():
                    phases[name] = max(phases.get(name, 0.0), seconds)
            if before_resume is not None:
                before_resume()
        except BaseException as e:
            failure = e
            raise
        finally:
            resumed = time.perf_counter()
            await self._resume(engines, failure)
            phases["resume"] = time.perf_counter() - resumed
            if paused := self._engine_pauses():
                phases["engine_paused"] = max(paused)
        reset = all(r for r, _ in loads)
        return WeightLoad(seconds=time.perf_counter() - start, prefix_cache_reset=reset, phases=phases)

    async def load_weights_staged(
        self,
        version: int,
        update_info: dict[str, Any],
        on_started: Callable[[], None],
        delivered: Callable[[], Awaitable[None]],
        before_swap: Callable[[], None],
    ) -> WeightLoad:
        """Load weight version `version` without pausing inference (`weights.no_stall`; a broadcast of an open
        transfer session): /start_weight_update, `on_started` (ACCEPT: the trainer starts its broadcast),
        /update_weights with `stage` (each worker receives the version in the background and the call returns at
        once), `delivered` (awaits the trainer's DELIVERED marker: its sends are complete, the repair round of a
        delta included), `before_swap`, /finish_weight_update (the swap: the staged version loads between two engine
        steps). vLLM generates with the version before until the swap, and stops only for it: `seconds` is the
        server's handled time of /finish_weight_update (the slowest engine's; the client's time where the server
        sends none). No /reset_prefix_cache: requests carry a per-version cache_salt (rollout/record.py), so cached KV
        never crosses versions. Phases: `start`, `on_started`, `stage_start`, `stage` (/update_weights until
        DELIVERED), `swap` and `swap_server`."""
        engines = self.admin_clients
        phases: dict[str, float] = {}
        last = time.perf_counter()

        def lap(name: str, path: str | None = None) -> None:
            nonlocal last
            now = time.perf_counter()
            phases[name], last = now - last, now
            timings = [t for e in engines if (t := e.server_timing.pop(path, None)) is not None] if path else []
            if known := [t.handled_s for t in timings if t.handled_s is not None]:
                phases[f"{name}_server"] = max(known)

        await asyncio.gather(*(e._start_weight_update(version) for e in engines))
        lap("start", "/start_weight_update")
        on_started()
        lap("on_started")
        staged_info = {**update_info, "stage": True}
        await asyncio.gather(*(e.post("/update_weights", json={"update_info": staged_info}) for e in engines))
        lap("stage_start", "/update_weights")
        await delivered()
        lap("stage")
        before_swap()
        body = {"weight_version": str(version)}
        await asyncio.gather(*(e.post("/finish_weight_update", json=body) for e in engines))
        lap("swap", "/finish_weight_update")
        stalled = phases.get("swap_server", phases["swap"])
        return WeightLoad(seconds=stalled, prefix_cache_reset=False, phases=phases, staged=True)

    async def load_lora_adapter(
        self,
        name: str,
        path: str,
        before_resume: Callable[[], None] | None = None,
        on_paused: Callable[[], None] | None = None,
    ) -> WeightLoad:
        """Serve the LoRA adapter folder `path` as model `name` (`--enable-lora`), replacing the adapter of that name
        in place, with in-flight requests frozen: /pause (keep), `on_paused`, /v1/load_lora_adapter (load_inplace),
        /reset_prefix_cache, `before_resume` (only if all succeeded), /resume. From then on requests name `name`."""
        start = time.perf_counter()
        engines = self.admin_clients
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        failure: BaseException | None = None
        try:
            await asyncio.gather(*(e.post("/pause", params={"mode": "keep", "clear_cache": "false"}) for e in engines))
            if on_paused is not None:
                on_paused()
            await asyncio.gather(*(e.post("/v1/load_lora_adapter", json=body, text_reply=True) for e in engines))
            resets = await asyncio.gather(*(e.post("/reset_prefix_cache") for e in engines))
            for client in (self, *self.engines):
                client.model_name = name
            if before_resume is not None:
                before_resume()
        except BaseException as e:
            failure = e
            raise
        finally:
            await self._resume(engines, failure)
        reset = all(bool((r or {}).get("success", False)) if isinstance(r, dict) else False for r in resets)
        paused = self._engine_pauses()
        phases = {"engine_paused": max(paused)} if paused else {}
        return WeightLoad(seconds=time.perf_counter() - start, prefix_cache_reset=reset, phases=phases)

    async def _resume(self, engines: "list[InferenceClient]", failure: BaseException | None) -> None:
        """/resume on every engine after a paused load. Its own error is raised only where the load succeeded: a
        load's error (a refused update) stays the one raised, with the resume's as a note. A server may close the
        connection a failed admin call came on, and the /resume sent on it then fails as if the server were lost."""
        results = await asyncio.gather(*(e.post("/resume") for e in engines), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and failure is not None:
            failure.add_note(f"/resume after it failed too: {type(errors[0]).__name__}: {errors[0]}")
        elif errors:
            raise errors[0]

    def _engine_pauses(self) -> list[float]:
        """Each engine's pause as its server measured it (/resume's reply header; none from a server without
        Slipstream's middleware)."""
        timings = [t for e in self.admin_clients if (t := e.server_timing.pop("/resume", None)) is not None]
        return [t.paused_s for t in timings if t.paused_s is not None]

    async def _load_paused(
        self, version: int, update_info: dict[str, Any], init_info: dict[str, Any] | None
    ) -> tuple[bool, dict[str, float]]:
        """The load itself on one paused engine: whether its prefix cache was reset, and each call's seconds."""
        phases: dict[str, float] = {}
        last = time.perf_counter()

        def lap(name: str, path: str) -> None:
            nonlocal last
            now = time.perf_counter()
            phases[name], last = now - last, now
            timing = self.server_timing.pop(path, None)  # the server's own part (inference/auth.py's reply header)
            if timing is not None and timing.handled_s is not None:
                phases[f"{name}_server"] = timing.handled_s

        if init_info is not None:
            await self.post("/init_weight_transfer_engine", json={"init_info": init_info})
            lap("init", "/init_weight_transfer_engine")
        await self._start_weight_update(version)
        lap("start", "/start_weight_update")
        await self.post("/update_weights", json={"update_info": update_info})
        lap("transfer", "/update_weights")
        await self.post("/finish_weight_update", json={"weight_version": str(version)})
        lap("finish", "/finish_weight_update")
        reset = await self.post("/reset_prefix_cache")
        lap("reset", "/reset_prefix_cache")
        return bool((reset or {}).get("success", False)), phases

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
