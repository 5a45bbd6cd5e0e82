"""No-stall weight updates (`weights.no_stall`), the worker's half: a version's buckets are received by a background
thread into staging memory while vLLM keeps generating with the version before, and are handed over whole for the
swap, which the engine runs inside /finish_weight_update (between two engine steps: no step sees a mix of versions).

Call order: `start(update_info)` (from /update_weights with `"stage": true`; returns once the thread runs), then
`take()` (from /finish_weight_update: joins the thread, normally done by then, and returns the staged buckets, or
raises what went wrong in the thread as StagingFailed). Nothing here touches the model.

Staging memory: a plain broadcast lands in a buffer per bucket (one copy of the published weights, kept from one
version to the next while the bucket plan stays); a delta broadcast needs none more, since the receiver's mirror of
the version before (weights/receive/delta_receive.py) is applied in place and its views are what the swap loads. The
memory is allocated by `start`, before anything is received, so a worker that cannot hold it fails the update at once
with an error that says so.

On CUDA (NCCL) the thread queues its receives from a CUDA stream of its own: the broadcasts' waits land on that
stream, never on the stream vLLM's forward passes run on, so generation does not queue behind a transfer (it shares
the GPU with NCCL's kernels meanwhile). The thread returns once the device has finished them (the receiver
synchronizes the device from this thread, which blocks no other), so the swap reads complete buffers. Tested on CPU
workers (gloo); measured on 2 x H200 with vLLM 0.26.0 (benchmarks/RESULTS.md): the swap took 4-14 ms on the 0.6B and
the 8-layer 30B-A3B shapes, against 0.35-0.5 s paused.
"""

import logging
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from slipstream.weights.receive.bucket_receive import ReceiveBuffers
from slipstream.weights.receive.receiver import ReceiveStats, WeightReceiver
from slipstream.weights.wire.published import STAGING_FAILED
from slipstream.weights.wire.stream import Manifest

logger = logging.getLogger(__name__)


class StagingFailed(RuntimeError):
    """The version could not be staged; the model still serves the version before, whole and untouched."""


@dataclass
class StagedVersion:
    """A version received whole into staging memory: its buckets' (name, tensor) views, in the order to load them."""

    buckets: list[list[tuple[str, torch.Tensor]]]
    stats: ReceiveStats
    manifest: Manifest
    waited_s: float = 0.0
    """How long `take` waited for the thread (the residual wait: the swap's caller is blocked meanwhile)."""


class Stager:
    """One worker's staging of versions, one at a time (see the module docstring)."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver
        self.buffers = ReceiveBuffers(receiver.device, keep_all=True)
        self._thread: threading.Thread | None = None
        self._staged: StagedVersion | None = None
        self._error: BaseException | None = None
        self._step: int | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def active(self) -> bool:
        """A version was started and not yet taken."""
        return self._thread is not None

    def start(self, update_info: dict) -> None:
        """Start receiving `update_info`'s broadcast (`{"step": N, "manifest": {...}}`) in the background; returns at
        once. Raises StagingFailed when a version is staged already, the update is no broadcast, or the staging memory
        cannot be allocated."""
        if self._thread is not None:
            raise StagingFailed(f"{STAGING_FAILED}: version {self._step} is still staged; finish_weight_update first")
        step = update_info.get("step")
        if "manifest" not in update_info or "shared" in update_info:
            raise StagingFailed(
                f"{STAGING_FAILED}: version {step} is not a broadcast (update_info keys {sorted(update_info)}); only "
                "broadcasts are staged: load folders and shared memory paused"
            )
        if self.receiver.group is None:
            raise StagingFailed(
                f"{STAGING_FAILED}: version {step}: this worker has not joined the sender's group; call "
                "/init_weight_transfer_engine first"
            )
        manifest = Manifest.from_dict(update_info["manifest"])
        if not manifest.delta:  # a delta lands in the receiver's mirror: no memory more
            try:
                self.buffers.resize(self.receiver.buffers.num_slots)  # its wire buffers (several senders)
                self.buffers.start(manifest)
            except RuntimeError as e:  # torch's allocation failure (CPU: RuntimeError; CUDA: OutOfMemoryError)
                self.buffers.release()
                raise StagingFailed(
                    f"{STAGING_FAILED}: version {step}: staging needs one more copy of the published weights "
                    f"({manifest.nbytes / 2**20:.1f} MiB) on this worker's {self.receiver.device}, which could not be "
                    f"allocated ({e}); leave vLLM less of the device's memory, or set weights.no_stall = false"
                ) from e
        self._step, self._staged, self._error = step, None, None
        self._thread = threading.Thread(
            target=self._run, args=(update_info,), name="slipstream-weight-staging", daemon=True
        )
        self._thread.start()

    def _run(self, update_info: dict) -> None:
        buckets: list[list[tuple[str, torch.Tensor]]] = []
        try:
            with self._receive_stream():
                stats = self.receiver.receive(update_info, buckets.append, buffers=self.buffers)
            self._staged = StagedVersion(buckets, stats, Manifest.from_dict(update_info["manifest"]))
        except BaseException as e:  # noqa: BLE001 - kept and raised by take(), on the caller's thread
            self._error = e

    def _receive_stream(self) -> AbstractContextManager:
        """On CUDA: this thread's receives queued on a stream of their own (kept from one version to the next)."""
        device = self.receiver.device
        if device.type != "cuda":
            return nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self._stream)

    def take(self) -> StagedVersion:
        """Wait for the staging thread and return the staged version; StagingFailed with the thread's error."""
        thread = self._thread
        if thread is None:
            raise StagingFailed(f"{STAGING_FAILED}: no version is staged (update_weights with stage first)")
        start = time.perf_counter()
        thread.join()
        waited = time.perf_counter() - start
        staged, error, step = self._staged, self._error, self._step
        self._thread, self._staged, self._error, self._step = None, None, None, None
        if error is not None:
            raise StagingFailed(f"{STAGING_FAILED}: version {step}: {type(error).__name__}: {error}") from error
        assert staged is not None
        staged.waited_s = waited
        return staged

    def abandon(self) -> None:
        """A staged version that will never be swapped in (a new update started): wait for its thread, drop it, and
        log what became of it."""
        if self._thread is None:
            return
        try:
            staged = self.take()
            logger.warning("slipstream weight transfer: version %s was staged but never swapped in", staged.stats.step)
        except StagingFailed as e:
            logger.warning("slipstream weight transfer: dropping a version never swapped in: %s", e)

    def release(self) -> None:
        """Free the staging memory (the session ends)."""
        self.abandon()
        self.buffers.release()
