"""Event-driven decode engine of the simulator: capacity slots, pause modes, policy version of every token.

Sequences do not wake per token: tokens are due at fixed points of a sequence's unpaused time, and every state
change (pause, abort, weight load) first emits the tokens already due, so each token records the policy version
that was served when it was generated.
"""

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Literal

from slipstream_sim.config import LatencyModel, SimConfig
from slipstream_sim.policy import sim_logprob

PauseMode = Literal["abort", "wait", "keep"]


class SimRequestError(ValueError):
    """The caller did something the real server would refuse (HTTP 4xx)."""


class SimClosedError(RuntimeError):
    """The simulator is shutting down (HTTP 503)."""


@dataclass
class RequestRecord:
    """What the simulator saw of one generation request (for tests and benchmarks)."""

    endpoint: str
    cache_salt: str | None
    n: int
    max_tokens: int
    version_at_arrival: int
    arrival_s: float


@dataclass(eq=False)  # identity semantics: sequences live in a set
class Sequence:
    """One choice being decoded: its planned tokens are emitted one by one as unpaused time passes."""

    planned_ids: list[int]
    planned_finish: str
    interval_s: float
    """Unpaused seconds per token."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prefill_version: int | None = None
    finish_reason: str | None = None
    aborted: bool = False
    active_s: float = 0.0
    resumed_at: float | None = None
    """Loop time since which the sequence accrues decode time; None while waiting, frozen or done."""
    progress: asyncio.Event | None = None
    """Streamed sequences: set whenever tokens are emitted or the sequence ends (the streamer clears it); such a
    sequence emits each token when it is due instead of all due tokens at the next state change."""

    @property
    def done(self) -> bool:
        return len(self.token_ids) == len(self.planned_ids)

    def remaining_s(self) -> float:
        return max(0.0, len(self.planned_ids) * self.interval_s - self.active_s)

    def next_due_s(self) -> float:
        """Unpaused seconds until the next token is due (streamed sequences wake for each token)."""
        if self.progress is None:
            return self.remaining_s()
        return max(0.0, (len(self.token_ids) + 1) * self.interval_s - self.active_s)

    def num_due(self) -> int:
        if self.interval_s <= 0:
            return len(self.planned_ids)
        return min(len(self.planned_ids), math.floor(self.active_s / self.interval_s + 1e-9))


class SimEngine:
    """State of the simulated server; all methods run on the server's event loop."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.version = config.initial_version
        self.paused = False
        """New requests are held until /resume."""
        self.frozen = False
        """Pause mode "keep": in-flight sequences make no progress."""
        self.closed = False
        self.asleep: set[str] = set()
        """What vLLM's sleep mode has freed ("weights", "kv_cache"): generation and weight loads need them back."""
        self.sleeping = False
        """Between /sleep and the /wake_up that leaves nothing asleep (level 0 frees nothing but still sleeps)."""
        self.sleep_calls: list[int] = []
        self.requests_while_sleeping = 0
        """Generation requests that arrived while asleep (vLLM holds them until it wakes)."""
        self.wake_calls: list[list[str] | None] = []
        self.records: list[RequestRecord] = []
        self.loads: list[str] = []
        self.num_held = self.num_waiting = self.num_running = 0
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self._latency = LatencyModel.from_config(config)
        self._rng = random.Random(config.seed)
        self._slots = asyncio.Semaphore(config.capacity)  # binds to the loop of its first use: one run per engine
        self._in_flight: set[Sequence] = set()
        self._changed: asyncio.Future | None = None

    def record(self, endpoint: str, cache_salt: str | None, n: int, max_tokens: int) -> None:
        self.requests_while_sleeping += self.sleeping
        self.records.append(RequestRecord(endpoint, cache_salt, n, max_tokens, self.version, time.time()))

    def sequences(self, plans: list[tuple[list[int], str]], streamed: bool = False) -> list[Sequence]:
        """The sequences of one request's planned choices (`streamed`: each token emitted when due)."""
        seqs = []
        for token_ids, finish in plans:
            interval = self.config.token_latency_s + self._latency.sample(self._rng) / len(token_ids)
            progress = asyncio.Event() if streamed else None
            seqs.append(Sequence(planned_ids=token_ids, planned_finish=finish, interval_s=interval, progress=progress))
        return seqs

    async def generate(self, plans: list[tuple[list[int], str]], num_prompt_tokens: int) -> list[Sequence]:
        """Decode one request's choices (held while paused, then each in its own capacity slot)."""
        return await self.decode(self.sequences(plans), num_prompt_tokens)

    async def decode(self, seqs: list[Sequence], num_prompt_tokens: int) -> list[Sequence]:
        """Decode the sequences of one request (held while paused, then each in its own capacity slot)."""
        self.num_held += len(seqs)
        try:
            while self.paused and not self.closed:
                await self._state_change()
        finally:
            self.num_held -= len(seqs)
        self.check_awake("generation")
        if self.closed:
            raise SimClosedError("the simulated server is shutting down")
        self.prompt_tokens_total += num_prompt_tokens
        await asyncio.gather(*(self._run(seq) for seq in seqs))
        return seqs

    async def _run(self, seq: Sequence) -> None:
        self._in_flight.add(seq)
        self.num_waiting += 1
        waiting = True
        try:
            async with self._slots:
                self.num_waiting, waiting = self.num_waiting - 1, False
                self.num_running += 1
                try:
                    await self._decode(seq)
                finally:
                    self.num_running -= 1
        finally:
            if waiting:  # cancelled before it got a slot
                self.num_waiting -= 1
            self._in_flight.discard(seq)
            self._notify()

    async def _decode(self, seq: Sequence) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.frozen:
                seq.resumed_at = None  # the pause already emitted what was due
            else:
                if seq.resumed_at is None:
                    seq.resumed_at = loop.time()
                    if seq.prefill_version is None:
                        seq.prefill_version = self.version
                self._catch_up(seq, loop.time())
            if seq.aborted or seq.done:
                break
            timeout = None if self.frozen else seq.next_due_s()
            await asyncio.wait([self._state_future()], timeout=timeout)
        seq.resumed_at = None
        seq.finish_reason = "abort" if seq.aborted and not seq.done else seq.planned_finish
        if seq.progress is not None:
            seq.progress.set()

    def _catch_up(self, seq: Sequence, now: float) -> None:
        """Accrue decode time up to `now` and emit the tokens due, at the version served now."""
        if seq.resumed_at is None or seq.aborted:
            return
        seq.active_s += now - seq.resumed_at
        seq.resumed_at = now
        for token_id in seq.planned_ids[len(seq.token_ids) : seq.num_due()]:
            seq.token_ids.append(token_id)
            seq.logprobs.append(sim_logprob(self.version, token_id))
            self.generation_tokens_total += 1
            if seq.progress is not None:
                seq.progress.set()

    def _catch_up_all(self) -> None:
        now = asyncio.get_running_loop().time()
        for seq in self._in_flight:
            self._catch_up(seq, now)

    async def pause(self, mode: PauseMode) -> None:
        """keep: freeze in-flight sequences; abort: end them now (finish_reason "abort"); wait: let them finish
        and return once none is left. In every mode new requests are held until resume()."""
        if mode not in ("abort", "wait", "keep"):
            raise SimRequestError(f"unknown pause mode {mode!r}; use abort, wait or keep")
        self._catch_up_all()
        self.paused = True
        self.frozen = mode == "keep"
        if mode == "abort":
            for seq in self._in_flight:
                seq.aborted = True
        self._notify()
        if mode == "wait":
            while self._in_flight:
                await self._state_change()

    def resume(self) -> None:
        self.paused = self.frozen = False
        self._notify()

    async def sleep(self, level: int, mode: PauseMode) -> None:
        """vLLM's /sleep: pause (mode), then free the KV cache and the weights (level >= 1; level 0 frees nothing)."""
        if level not in (0, 1, 2):
            raise SimRequestError(f"sleep level must be 0, 1 or 2 (got {level})")
        await self.pause(mode)
        self.sleep_calls.append(level)
        self.sleeping = True
        if level >= 1:
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None) -> bool:
        """vLLM's /wake_up: restore what `tags` names (None: everything); scheduling resumes once nothing is asleep.
        Returns whether it is fully awake."""
        self.wake_calls.append(tags)
        self.asleep -= set(self.asleep if tags is None else tags)
        if self.sleeping and not self.asleep:
            self.sleeping = False
            self.resume()
        return not self.sleeping

    def check_awake(self, what: str) -> None:
        """Generation and weight loads touch the memory sleep frees: refuse them while it is freed."""
        if self.asleep:
            raise SimRequestError(f"{what} while {', '.join(sorted(self.asleep))} sleep; call POST /wake_up first")

    def serve_version(self, version: int, source: str) -> None:
        """Serve policy `version` from now on (the end of a weight update; `source` is recorded in `loads`)."""
        self._catch_up_all()
        self.version = version
        self.loads.append(source)
        self._notify()

    def close(self) -> None:
        """Abort everything in flight and refuse held requests (server shutdown)."""
        self._catch_up_all()
        self.closed = True
        for seq in self._in_flight:
            seq.aborted = True
        self._notify()

    def _state_future(self) -> asyncio.Future:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    async def _state_change(self) -> None:
        await asyncio.shield(self._state_future())

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None
