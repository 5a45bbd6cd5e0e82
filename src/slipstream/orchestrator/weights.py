"""Weight relay: loads newly published weights as soon as they appear, while rollouts are in flight, and verifies
every load.

An update is pause(keep) -> load -> reset prefix cache -> resume: in-flight requests freeze and continue with the
new weights, nothing is drained or restarted. New requests are held back from the pause until the load is
verified, so every request sent after an update carries the new version's cache_salt. With `weights.no_stall` the
version is staged while inference generates and swapped in without a pause (orchestrator/weight_loads.py); new
requests are held back from the swap until the load is verified. An online evaluation holds
the served policy fixed (`hold()`): updates wait until it ends. Verification scores the
trainer's probe tokens on inference and compares log-probs, so a failed or partial weight update (a frozen or
corrupted policy) is caught instead of training silently.

When inference is lost (it died and is being restarted: rollout/client.py raises InferenceUnavailable), new requests are
held back and the relay recovers: it polls /health with exponential backoff (at most `recovery.timeout_s`), loads
the served version again on the server that answers, verifies it with the probe, and only then lets requests go.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.orchestrator.client import InferenceClient, WeightStagingFailed, WeightUpdateIncomplete
from slipstream.orchestrator.colocate import GpuTurns
from slipstream.orchestrator.weight_check import WeightChecker, WeightSyncError, failure_message
from slipstream.orchestrator.weight_loads import WeightLoader
from slipstream.rollout.client import InferenceUnavailable
from slipstream.rundir import RunDir, prune_weights, step_dirs, weights_to_keep
from slipstream.transport.checkpoints import committed_run_steps, resume_weight_steps
from slipstream.weights.wire.offers import latest_available_step, wait_for_available
from slipstream.weights.wire.published import is_ready

log = logging.getLogger(__name__)

INITIAL_WEIGHT_VERSION = "default"
"""vLLM's /weight_info of a server that has finished no weight update since it started."""


class WeightRelay:
    """Tracks the policy version inference serves (0 = initial weights) and updates it as weights are published.

    `served_version` switches right before /resume, or when a no-stall swap returns (see streaming.py for why
    tokens are stamped with it); `updating` is true from /pause (no-stall: the swap) until the load is verified; `accepting` is false while updating or while
    inference is unavailable (until recovered); `on_change` is called whenever any of them changes.
    """

    def __init__(self, client: InferenceClient, config: OrchestratorConfig, served_version: int = 0) -> None:
        self.client = client
        self.config = config
        self.output_dir = Path(config.output_dir).resolve()
        self.served_version = served_version
        lora_name = config.model.lora.name if config.model.lora is not None else None
        self.loader = WeightLoader(client, self.output_dir, config.weights, lora_name=lora_name)
        # LoRA adapters are scored one position at a time (see InferenceClient.score_tokens_per_position)
        self.checker = WeightChecker(
            client, self.output_dir, config.weight_check, config.weight_check_tolerance, lora_name is not None
        )
        self.updating = False
        self.staging = False
        """A no-stall update stages its version (new requests go on; no evaluation may hold the policy, which the
        swap will change)."""
        self.on_change: Callable[[], None] = lambda: None
        self.pending_metrics: dict[str, float] = {}
        """Metrics of the updates since the last batch (taken by the pipeline into the next batch)."""
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        """Set by stop() and when inference is lost, so watch() reacts before its next poll."""
        self._lock = asyncio.Lock()
        """Serialises weight loads: updates and recoveries."""
        self._reload: asyncio.Future[float | None] | None = None
        """A recovery's load of the served weights onto the server that came back, while it runs."""
        self.turns: GpuTurns | None = None
        """Colocated (set by the pipeline): vLLM may sleep; it is woken before a load, and a served version can end
        the trainer's turn (colocate.py)."""
        self._num_holds = 0
        self._unheld = asyncio.Event()
        self._unheld.set()
        client.on_unavailable = self._lost

    @property
    def held(self) -> bool:
        """Whether an evaluation holds the served policy (see hold())."""
        return self._num_holds > 0

    @property
    def accepting(self) -> bool:
        """Whether new requests may be sent: no update in progress, inference available with the served weights."""
        return not self.updating and self.client.available

    def _lost(self, error: InferenceUnavailable) -> None:
        if not self._wake.is_set():
            self._wake.set()
        self.on_change()

    async def watch(self, num_batches: Callable[[], int]) -> None:
        """Load the newest published weights whenever they are newer than the served ones, until stop()."""
        while not self._stop.is_set():
            self._wake.clear()
            if not self.client.available:
                await self._recover_unless_stopped()
                continue
            newest = await asyncio.to_thread(latest_available_step, self.output_dir)
            if self._stop.is_set():
                break
            if newest is not None and newest > self.served_version:
                if newest > num_batches():
                    raise RuntimeError(
                        f"{RunDir(self.output_dir).weights_dir(newest)} exists though only {num_batches()} batches were "
                        f"written: {self.output_dir} holds weights of another run; use a fresh output_dir"
                    )
                if self._num_holds:  # an evaluation holds the policy: load what is newest once it ends
                    await self._wait_unheld()
                    newest = await asyncio.to_thread(latest_available_step, self.output_dir)
                try:
                    await self.update(newest)
                except InferenceUnavailable:
                    continue  # lost mid-update: recover (the served version again), then load the newest
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.weights_poll_s)
            except TimeoutError:
                pass

    def stop(self) -> None:
        """Let watch() return after its current poll or update (an update is never interrupted, nor a recovery that
        is loading; one still waiting for the server is)."""
        self._stop.set()
        self._wake.set()

    async def serve_initial(self) -> None:
        """Before the first rollout (fresh or resumed): make inference serve this run's initial weights (version 0).
        A server that finished a weight update since it started (vLLM's /weight_info names a version, not "default")
        serves another run's policy, e.g. a long-lived inference server a restarted run reuses: the model's own
        checkpoint is loaded back first, saying so, so that rollouts and the weight check's calibration see the
        initial weights (a server that cannot tell, no /weight_info, too). KV another run cached is never reused: each
        client start salts its requests within its own scope (GenerationClient.salt_scope), so nothing needs freeing
        here, and runs sharing a server (LoRA tenants) never wait on each other. With model.lora the base weights are
        left alone: vLLM with LoRA takes only adapters (its layers wrap the base weights, which a full load cannot
        name), so no run changed them, and this run's adapter is loaded by name at its first version."""
        versions = await self.client.weight_versions()
        stale = {url: version for url, version in versions.items() if version != INITIAL_WEIGHT_VERSION}
        if stale and self.config.model.lora is not None:
            log.info(f"model.lora: inference keeps its base weights, which LoRA runs never change ({stale})")
        elif stale:
            folder = self._initial_weights_dir()
            served = ", ".join(
                f"{url}: {'unknown' if v is None else f'weight version {v!r}'}" for url, v in stale.items()
            )
            log.info(
                f"inference may serve weights another run loaded ({served}), not this run's initial ones: loading the "
                f"initial weights from {folder} before the first rollout"
            )
            load = await self.client.load_weights(
                0, {"step": 0, "model": str(folder)}, before_resume=lambda: self._serve(0)
            )
            log.info(f"inference serves the initial weights again (loaded in {load.seconds:.1f}s)")

    def _initial_weights_dir(self) -> Path:
        model = self.config.model
        folder = model.path if model.path is not None else Path(model.name)
        if not folder.is_dir():
            raise RuntimeError(
                f"inference serves weights loaded after it started, and the orchestrator cannot load the initial ones "
                f"back: model.path is unset and model.name ({model.name}) is no local folder. Start it through "
                "`slipstream rl` (which sets model.path), or restart the inference server"
            )
        return folder

    async def _recover_unless_stopped(self) -> None:
        """Recover, unless stop() comes first: a recovery still waiting for the server is cancelled, one already
        loading the served weights onto it is let finish (cancelled mid-load, it would leave the server half-loaded,
        and the run's final load would find it so and recover once more)."""
        recovery = asyncio.ensure_future(self.ensure_available())
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([recovery, stopped], return_when=asyncio.FIRST_COMPLETED)
            reload = self._reload
            if not recovery.done() and reload is not None:
                await asyncio.wait([reload])
                if not reload.cancelled() and reload.exception() is None:
                    await asyncio.wait([recovery])  # what is left of it runs without waiting
        finally:
            for task in (recovery, stopped):
                task.cancel()
            await asyncio.gather(recovery, stopped, return_exceptions=True)
        if recovery.done() and not recovery.cancelled() and recovery.exception() is not None:
            raise recovery.exception()  # type: ignore[misc]  # checked just above

    async def ensure_available(self) -> None:
        """If inference was lost, wait for it and re-establish the served weights (see the module docstring)."""
        async with self._lock:
            if not self.client.available:
                await self._recover()

    async def _recover(self) -> None:
        cfg, reason = self.config.recovery, self.client.unavailable_reason
        url = f"{self.client.base_url}/health"
        log.warning(
            f"inference unavailable ({reason}); new requests wait until it answers {url} again "
            f"(at most recovery.timeout_s = {cfg.timeout_s:g}s) and serves policy v{self.served_version} again"
        )
        start = time.perf_counter()
        deadline = time.monotonic() + cfg.timeout_s
        hint = (
            f"it became unavailable ({reason}) and did not come back; is it being restarted (launch.inference_"
            "restarts)? Raise orchestrator.recovery.timeout_s if it needs longer to start"
        )
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"waited {cfg.timeout_s:g}s for the inference server at {url}: {hint}")
            instance = await self.client.wait_healthy(remaining, cfg.backoff_initial_s, cfg.backoff_max_s, hint)
            self.client.instance = instance
            if self.turns is not None:
                self.turns.woke_elsewhere()  # a restarted server starts awake
            self._reload = asyncio.ensure_future(self._reload_served())
            try:
                check = await self._reload
                break
            except InferenceUnavailable as e:
                log.warning(f"inference lost again while re-establishing its weights ({e})")
            finally:
                self._reload = None
        self.client.mark_available()
        seconds = time.perf_counter() - start
        m = self.pending_metrics
        m["inference/num_recoveries"] = m.get("inference/num_recoveries", 0.0) + 1
        m["timing/inference_recovery_s"] = m.get("timing/inference_recovery_s", 0.0) + seconds
        verified = "" if check is None else f", verified (probe max |diff| {check:.2g})"
        log.info(
            f"inference back after {seconds:.1f}s (instance {instance}); serving policy "
            f"v{self.served_version} again{verified}; new requests resume"
        )
        self.on_change()

    async def _reload_served(self) -> float | None:
        """Re-establish the served policy on a (possibly restarted) server and verify it. Version 0 is the model it
        starts with (nothing to load, no trainer probe to verify it with). A version that is not on disk (it came by
        broadcast) is gone with the server: the next version the trainer offers is loaded instead."""
        version = self.served_version
        if version == 0:
            return None
        if not is_ready(self.output_dir, version):
            version = await asyncio.to_thread(
                wait_for_available, self.output_dir, version + 1, self.config.weights_timeout_s
            )
        await self.loader.load(version, before_resume=lambda: self._serve(version))  # admin calls are not held back
        return await self._verify(version, after_restart=True)

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[int]:
        """Keep the served policy fixed for the block (updates wait for its end); yields the served version."""
        if not self.accepting or self.staging:
            raise RuntimeError(
                "the policy cannot be held while a weight update or an inference recovery is in progress"
            )
        self._num_holds += 1
        self._unheld.clear()
        try:
            yield self.served_version
        finally:
            self._num_holds -= 1
            if not self._num_holds:
                self._unheld.set()
                self.on_change()  # a colocated hand-over waits for no hold (pipeline._idle)

    async def _wait_unheld(self) -> None:
        """Wait until no hold is left; the time waited goes into `timing/weight_update_held_s`."""
        if not self._num_holds:
            return
        start = time.perf_counter()
        while self._num_holds:
            await self._unheld.wait()
        m = self.pending_metrics
        m["timing/weight_update_held_s"] = m.get("timing/weight_update_held_s", 0.0) + time.perf_counter() - start

    async def update(self, version: int) -> None:
        """Load `weights/step_<version>` in place with requests in flight, then verify it (after any hold).
        InferenceUnavailable if inference is lost (before or during it): recover, then update again."""
        await self._wait_unheld()
        async with self._lock:
            if not self.client.available:
                raise InferenceUnavailable(f"inference is unavailable ({self.client.unavailable_reason})")
            start = time.perf_counter()
            previous = self.served_version
            if self.turns is not None:
                await self.turns.wake()
            await self.checker.maybe_calibrate(version, previous)  # inference still serves `previous`
            if self.config.weights.no_stall:
                self.staging = True  # until the swap (or the pause of a version that loads paused)
            else:
                self._stall()  # a paused update holds new requests from its start (no-stall: from the swap on)
            try:
                try:
                    load = await self.loader.load(
                        version, before_resume=lambda: self._serve(version), on_stall=self._stall
                    )
                except WeightUpdateIncomplete as e:
                    raise WeightSyncError(
                        f"weight update to step {version} did not load whole on inference, so it serves a mix of "
                        f"versions; the run stops ({e})"
                    ) from e
                except WeightStagingFailed as e:
                    raise WeightSyncError(
                        f"weight update to step {version} could not be staged on inference (weights.no_stall), which "
                        f"still serves step {previous} whole; the run stops ({e})"
                    ) from e
                check = await self._verify(version, previous)
            finally:
                self.updating = self.staging = False
                self.on_change()
        if self.turns is not None:
            self.turns.to_inference(version)
        m = self.pending_metrics
        m["timing/weight_update_s"] = m.get("timing/weight_update_s", 0.0) + time.perf_counter() - start
        # what in-flight requests waited: the pause until the resume (new ones also wait for the check)
        # a staged update (weights.no_stall): the swap alone, the time vLLM did not generate
        m["timing/weight_pause_s"] = m.get("timing/weight_pause_s", 0.0) + load.seconds
        for phase, seconds in load.phases.items():  # where the pause went (client.WeightLoad.phases)
            key = f"timing/weight_pause/{phase}_s"
            m[key] = m.get(key, 0.0) + seconds
        m["weights/num_updates"] = m.get("weights/num_updates", 0.0) + 1
        if load.staged:  # while vLLM generated: /update_weights (stage) until the trainer's DELIVERED
            stage = load.phases.get("stage_start", 0.0) + load.phases.get("stage", 0.0)
            m["timing/weight_stage_s"] = m.get("timing/weight_stage_s", 0.0) + stage
            m["weights/num_staged_updates"] = m.get("weights/num_staged_updates", 0.0) + 1
        else:
            reset = float(load.prefix_cache_reset)
            m["weights/prefix_cache_reset"] = min(m.get("weights/prefix_cache_reset", 1.0), reset)
            if self.config.weights.no_stall:  # declared: a new session's version, or one from disk
                m["weights/num_paused_updates"] = m.get("weights/num_paused_updates", 0.0) + 1
        if check is not None:
            m["weight_sync/max_abs_diff"] = max(m.get("weight_sync/max_abs_diff", 0.0), check)
        pruned = await asyncio.to_thread(self.prune)
        m["weights/num_pruned"] = m.get("weights/num_pruned", 0.0) + len(pruned)

    def prune(self) -> list[int]:
        """Delete published weights nothing needs any more (see rundir.weights_to_keep): older than the served
        version, not kept for resume (checkpoint steps), nor among the `weights.keep_weights` newest."""
        run, c = RunDir(self.output_dir), self.config
        published = sorted(step_dirs(run.weights_root))
        for_resume = resume_weight_steps(
            committed_run_steps(self.output_dir), published, c.checkpoint.interval, c.max_steps
        )
        keep = weights_to_keep(published, self.served_version, set(), set(), for_resume, c.weights.keep_weights)
        return prune_weights(run, keep)

    def _stall(self) -> None:
        """Inference stops generating for the load: new requests wait until it is verified."""
        if not self.updating:
            self.updating, self.staging = True, False
            self.on_change()

    def _serve(self, version: int) -> None:
        self.served_version = version
        self.on_change()

    def take_metrics(self) -> dict[str, float]:
        metrics, self.pending_metrics = self.pending_metrics, {}
        return metrics

    async def load_final(self, final_step: int) -> None:
        """After the last batch: serve (and verify) every version the trainer still publishes up to its final one,
        so the run ends with inference serving the trained policy. Versions offered by broadcast are taken in turn:
        the trainer waits for each before it publishes the next."""
        while True:
            await self.ensure_available()
            if self.served_version >= final_step:
                return
            newest = await asyncio.to_thread(
                wait_for_available, self.output_dir, self.served_version + 1, self.config.weights_timeout_s
            )
            try:
                await self.update(newest)
            except InferenceUnavailable:
                continue  # recover, then load again

    async def _verify(
        self, version: int, previous_version: int | None = None, after_restart: bool = False
    ) -> float | None:
        """Check the load if `weight_check.enabled` (orchestrator/weight_check.py); return the probe's max |diff|
        (None when disabled). `previous_version`: what inference served before this load."""
        if not self.config.weight_check.enabled:
            return None
        check = await self.checker.verify(version, previous_version, after_restart)
        if not check["passed"]:
            message = failure_message(check, self.output_dir)
            if self.config.weight_check.stop_on_failure:
                raise WeightSyncError(message)
            log.warning(message)
        return check["max_abs_diff"]
