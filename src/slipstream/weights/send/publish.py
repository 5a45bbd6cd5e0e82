"""Publish the policy after every step as weight version N, streamed layer by layer (weights/send/export.py):

- `filesystem`: into `weights/step_N/` as safetensors shards + config + tokenizer + probe.json + READY, built under a
  temporary name and renamed into place;
- `nccl` / `gloo`: offered by broadcast (weights/wire/offers.py). Every trainer rank sends the rows it holds
  (weights/send/piece_send.py: no gather, each byte crosses the link once) when the model's sharding allows; otherwise
  rank 0 sends each bucket as soon as it is gathered, while the next layer is being gathered. Checkpoint steps (and
  the last step) are also written to disk, since resume and users need them there.

Files: every rank gathers (FSDP collectives); rank 0 writes. The probe (log-probs of a fixed text) is computed
from the published dtype's weights, so the orchestrator can check that inference serves exactly them.
"""

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from slipstream.config.trainer import TrainerConfig
from slipstream.trainer.setup import Trainer
from slipstream.transport.checkpoints import is_checkpoint_step
from slipstream.utils.fs import atomic_write_text, commit_dir
from slipstream.weights.send.changes import ChangeTracker
from slipstream.weights.send.delta_send import DeltaSender
from slipstream.weights.send.export import HFWeightStream
from slipstream.weights.send.folder import (
    PublishedFiles,
    cast_model,
    compute_probe_logprobs,
    make_world_readable,
    write_weights_folder,
)
from slipstream.weights.send.lora_export import MERGED_DIR, adapter_plan, gather_adapter, write_peft_adapter
from slipstream.weights.send.piece_send import NotDirect, PieceSender
from slipstream.weights.send.send_watch import SendWatch
from slipstream.weights.wire.bucket_assembly import BucketBuffers, stream_to
from slipstream.weights.wire.collective import GroupInit, close_group, open_group, open_store, receivers_posted
from slipstream.weights.wire.offers import (
    MANIFEST,
    OFFER,
    Accept,
    mark_delivered,
    wait_delivered,
    wait_for_accept,
)
from slipstream.weights.wire.published import PROBE, READY, weights_dir
from slipstream.weights.wire.shared_buffer import SharedBuffer, SharedSink, bucket_offsets
from slipstream.weights.wire.stream import (
    BroadcastSink,
    BucketSink,
    Manifest,
    SafetensorsSink,
    TolerantSink,
    plan_buckets,
    plan_pipelined,
)

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 600.0
"""How long a version's broadcasts may take to complete once queued (the transfer group's timeout)."""
SENT_POLL_S = 0.00005
"""How often the trainer checks that a version's broadcasts completed (a CUDA event's query), after SENT_SPIN_S."""
SENT_SPIN_S = 0.05
"""For this long the trainer checks without sleeping (a 1.2 GB version takes ~4 ms on an H200's NVLink, an 8-layer
Qwen3-30B-A3B slice ~35 ms)."""


def resolve_transport(transport: str, device: torch.device) -> str:
    """`auto`: nccl when the trainer runs on CUDA, else filesystem."""
    if transport == "auto":
        return "nccl" if device.type == "cuda" else "filesystem"
    return transport


class WeightPublisher:
    """Publishes weight versions for one trainer process (every rank has one; rank 0 does the writing/sending).

    With `model.lora` and `adapters` (the RL trainer) a version is the LoRA adapter alone, written as a PEFT folder
    (weights/send/lora_export.py) that inference loads in place; without `adapters` (SFT's final export) it is the
    merged model."""

    def __init__(self, trainer: Trainer, config: TrainerConfig, adapters: bool = False) -> None:
        self.trainer, self.config = trainer, config
        self.lora = config.model.lora if adapters else None
        self.adapter_plan = adapter_plan(trainer.model) if self.lora is not None else None
        # An adapter is small: it always goes through the filesystem (vLLM's LoRA loader reads a folder).
        self.transport = "filesystem" if self.lora else resolve_transport(config.weights.transport, trainer.device)
        self.bucket_bytes = config.weights.bucket_mb << 20
        self.store = None
        self.group = None
        self.session: str | None = None
        self.refused: set[str] = set()
        self.previous: tuple[int, list[float]] | None = None
        """(version, probe log-probs) of the last version published or noted (note_start_probe)."""
        self.wire_s: float | None = None
        """Collective transports: the last publish's seconds in its sends (joining a new session included), without
        the offer, the wait for an accept and the delivery files; None for the others."""
        self.receiver_wait_s = 0.0
        """Collective transports: this version's wait for the receivers to post their receives (not the transfer)."""
        if self.transport in ("nccl", "gloo") and trainer.info.is_main:
            w = config.weights
            port = w.store_port("the trainer's weight transfer")
            self.store = open_store(w.master_addr, port, is_master=True, timeout_s=w.accept_timeout_s)
        self.files = PublishedFiles(trainer.hf_config, trainer.compute_dtype, trainer.tokenizer, trainer.model_dir)
        self.stream = HFWeightStream(trainer.model, trainer.compute_dtype)  # the per-layer plan, built once
        metas = self.stream.metas()
        self.buckets = tuple(plan_buckets(metas, self.bucket_bytes))
        self.buffers = BucketBuffers()
        """Rank 0's bucket buffers (3 buckets of `weights.bucket_mb`), kept from one version to the next."""
        self.shared: SharedBuffer | None = None
        """The ipc transport's buffer (rank 0), allocated at the first version it carries."""
        self.last_shared: int | None = None
        """The last version offered from `shared`: the next one waits until inference has taken it."""
        self.pieces: PieceSender | None = None
        """Every rank sends its own rows by broadcast (None: rank 0 sends after a gather)."""
        self.delta: DeltaSender | None = None
        """`weights.delta` (rank 0): each version sent as changes since the one before (weights/send/delta_send.py)."""
        if config.weights.delta.enabled:
            if self.lora is not None:
                raise ValueError(
                    "weights.delta sends full-model versions as changes, but with model.lora the trainer publishes "
                    "only the adapter (through files): set weights.delta.enabled = false"
                )
            if self.is_main:
                self.delta = DeltaSender(config.weights.delta.full_every, trainer.device)
            log.info("weights: delta updates; trainer rank 0 sends every bucket after gathering it")
        elif self.transport in ("nccl", "gloo"):
            try:
                edge = config.weights.edge_bucket_mb
                plan = self.buckets
                if edge is not None:  # each rank holds its rows already: any order will do, so one for the pipeline
                    plan = tuple(plan_pipelined(metas, self.bucket_bytes, edge << 20))
                self.pieces = PieceSender(self.stream, plan, trainer.info.rank, trainer.world_size)
            except NotDirect as e:
                log.info(f"weights: trainer rank 0 sends every bucket after gathering it ({e})")
        self.changes: ChangeTracker | None = None
        """`weights.track_changes`: rank 0 compares each version with the one before (weights/send/changes.py)."""
        if config.weights.track_changes:
            if self.lora is not None:
                raise ValueError(
                    "weights.track_changes compares full-model versions, but with model.lora the trainer publishes "
                    "only the adapter: set weights.track_changes = false"
                )
            if self.pieces is not None and trainer.world_size > 1:
                raise ValueError(
                    "weights.track_changes compares whole buckets on trainer rank 0, but here every trainer rank "
                    f"sends its own rows ({self.transport} with a sharded model): set weights.track_changes = false, "
                    'or weights.transport = "filesystem" to measure the changes'
                )
            if self.is_main:
                self.changes = ChangeTracker()

    @property
    def is_main(self) -> bool:
        return self.trainer.info.is_main

    def note_start_probe(self) -> None:
        """Probe the weights inference starts with (the initial model, or the checkpoint resumed from; a collective
        with several ranks): the next version's probe carries them as `previous_logprobs`, so the orchestrator can
        measure trainer-vs-inference on identical weights before loading it (the check's noise floor) and catch a
        load that left the old policy in place. Not for LoRA adapters (inference serves no adapter at the start)."""
        if self.lora is None:
            self.previous = (self.trainer.start_step, probe_logprobs(self.trainer)["logprobs"])

    def publish(self, step: int) -> dict[str, float]:
        """Publish version `step`; returns metrics (bytes, seconds, attempts)."""
        start = time.perf_counter()
        probe = probe_logprobs(self.trainer)
        if self.previous is not None:  # the version before, on the same tokens (orchestrator/weight_check.py)
            probe |= {"previous_step": self.previous[0], "previous_logprobs": self.previous[1]}
            self.previous = (step, probe["logprobs"])
        stream = self.stream
        if self.pieces is not None and self.transport != "filesystem":
            manifest = self.pieces.manifest(step)
        else:
            manifest = Manifest(step, self.buckets, delta=self.config.weights.delta.enabled)
        t_probe = time.perf_counter()
        if self.lora is not None:
            return self._publish_adapter(step, probe) | {"weights/probe_s": t_probe - start}
        waited, self.wire_s, self.receiver_wait_s = 0.0, None, 0.0
        if self.changes is not None:
            self.changes.begin(step, manifest.buckets)
        if self.transport == "ipc":
            attempts, waited = self._publish_ipc(step, stream, manifest, probe)
        elif self.transport == "filesystem":
            attempts = self._publish_files(step, stream, manifest, probe)
        else:
            attempts, waited = self._publish_broadcast(step, stream, manifest, probe)
        seconds = time.perf_counter() - t_probe - waited - self.receiver_wait_s
        changes = self.changes.take() if self.changes is not None else {}
        if self.delta is not None:
            changes |= self.delta.take()
        if self.wire_s is not None:  # collective transports: the sends alone, without offer and delivery files
            changes |= {
                "weights/wire_s": self.wire_s,
                "weights/wire_gbps": manifest.nbytes / max(self.wire_s, 1e-9) / 1e9,
                "weights/receiver_wait_s": self.receiver_wait_s,
            }
        return changes | {
            "weights/bytes": float(manifest.nbytes),
            "weights/send_s": seconds,
            "weights/send_gbps": manifest.nbytes / max(seconds, 1e-9) / 1e9,
            "weights/accept_wait_s": waited,
            "weights/probe_s": t_probe - start,
            "weights/send_attempts": float(attempts),
        }

    def _publish_adapter(self, step: int, probe: dict) -> dict[str, float]:
        """`weights/step_N/` = the PEFT adapter + probe.json + READY, built under a temporary name (all ranks gather
        the adapters; rank 0 writes). The last step's folder also holds the merged model in `merged/` (a Hugging
        Face folder that `model.name` accepts)."""
        start = time.perf_counter()
        tensors = gather_adapter(self.adapter_plan, self.trainer.compute_dtype)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        folder = weights_dir(self.config.output_dir, step)
        tmp = folder.parent / f".tmp_{folder.name}_{os.getpid()}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if step == self.config.max_steps:  # every rank: the merged stream gathers FSDP shards
            manifest = Manifest(step, self.buckets)
            write_weights_folder(tmp / MERGED_DIR, self.stream, manifest, probe, self.files, self.is_main, self.buffers)
        if self.is_main:
            base = str(self.trainer.model_dir)
            write_peft_adapter(tmp, tensors, self.lora, self.adapter_plan, base)
            atomic_write_text(tmp / PROBE, _json(probe))
            atomic_write_text(tmp / READY, f"{step}\n")
            make_world_readable(tmp)
            commit_dir(tmp, folder)
        seconds = time.perf_counter() - start
        return {"weights/bytes": float(num_bytes), "weights/send_s": seconds, "weights/send_attempts": 1.0}

    def _keeps_files(self, step: int) -> bool:
        c = self.config
        if self.transport == "filesystem" or step == c.max_steps:
            return True  # the trained model stays on disk for users, evaluation and resume
        return is_checkpoint_step(step, c.checkpoint.interval, c.max_steps)

    def _publish_files(self, step: int, stream: HFWeightStream, manifest: Manifest, probe: dict) -> int:
        folder = weights_dir(self.config.output_dir, step)
        sinks = [self.changes] if self.changes is not None else []
        write_weights_folder(folder, stream, manifest, probe, self.files, self.is_main, self.buffers, sinks)
        return 1

    def _publish_ipc(self, step: int, stream: HFWeightStream, manifest: Manifest, probe: dict) -> tuple[int, float]:
        """Once inference has taken the version before from the shared buffer, lay this one out in it (rank 0; every
        rank iterates the stream, whose gathers are collectives) and offer it with the buffer's handle. Checkpoint
        steps and the last one go to disk instead (a READY folder: resume and users need them there). Returns
        (attempts, seconds waited for inference to take the version before)."""
        waited = 0.0
        if self.is_main and self.last_shared is not None:
            asked = time.perf_counter()
            wait_delivered(self.config.output_dir, self.last_shared, self.config.weights.accept_timeout_s)
            waited = time.perf_counter() - asked
        if self._keeps_files(step):
            return self._publish_files(step, stream, manifest, probe), waited
        sinks: list[BucketSink] = []
        sizes = [b.nbytes for b in manifest.buckets]
        if self.is_main:
            if self.shared is None:
                self.shared = SharedBuffer(bucket_offsets(sizes)[1], self.trainer.device, name=f"{os.getpid()}")
            sinks.append(SharedSink(self.shared, sizes))
            if self.changes is not None:
                sinks.append(self.changes)
        stream_to(stream, manifest, sinks, self.buffers)
        if self.is_main:
            assert self.shared is not None
            self._write_offer(weights_dir(self.config.output_dir, step), manifest, probe, self.shared.handle())
            self.last_shared = step
        return 1, waited

    def _publish_broadcast(
        self, step: int, stream: HFWeightStream, manifest: Manifest, probe: dict
    ) -> tuple[int, float]:
        """Offer version `step`, wait until the orchestrator accepts it, send it (again, until one session took it
        whole). Returns (attempts, seconds waited for an accept: inference's side, not the send)."""
        folder = weights_dir(self.config.output_dir, step)
        waited = 0.0
        files = self._keeps_files(step)
        if self.is_main:
            self._write_offer(folder, manifest, probe)
        attempts, self.wire_s = 0, 0.0
        while True:
            attempts += 1
            accept = None
            if self.is_main:
                asked = time.perf_counter()
                accept = wait_for_accept(
                    self.config.output_dir, step, self.refused, self.config.weights.accept_timeout_s
                )
                waited += time.perf_counter() - asked
            sending, receivers_before = time.perf_counter(), self.receiver_wait_s
            if self.pieces is not None:
                error = self._send_pieces(self._shared(accept), folder if files else None, manifest)
            else:
                error = self._send_gathered(accept, stream, manifest, folder if files else None)
            if error is None and self.group is not None:
                error = self._await_sent(step)
            self.wire_s = self.wire_s + time.perf_counter() - sending - (self.receiver_wait_s - receivers_before)
            if self._agree(error is None):
                break
            if error is not None:
                log.warning(
                    f"sending the weights of step {step} failed ({error}); waiting for inference to take them again"
                )
            if self.session is not None:
                self.refused.add(self.session)
            close_group(self.group)
            self.group, self.session = None, None
        if self.is_main:
            mark_delivered(self.config.output_dir, step, self.session or "")
            if files:
                self.files.write(folder, manifest, probe)
                atomic_write_text(folder / READY, f"{step}\n")
                make_world_readable(folder)
        return attempts, waited

    def _send_gathered(
        self, accept: Accept | None, stream: HFWeightStream, manifest: Manifest, folder: Path | None
    ) -> BaseException | None:
        """Every rank gathers, rank 0 sends each bucket (and writes it into `folder`, if given)."""
        sinks: list[BucketSink] = []
        sender = late = None
        if accept is not None:
            self._join(accept)
            late = self._wait_receivers(accept, manifest.step)
        if accept is not None and late is None:
            if self.delta is not None:
                assert self.session is not None  # set with the group by _join
                self.delta.begin(manifest.step, manifest.buckets, self.group, self.session, self._watch(manifest.step))
                sender = TolerantSink(self.delta)
            else:
                sender = TolerantSink(BroadcastSink(self.group, self.trainer.device, synchronize=False))
            sinks.append(sender)
            if folder is not None:
                sinks.append(SafetensorsSink(folder, len(manifest.buckets)))
            if self.changes is not None:
                sinks.append(self.changes)
        stream_to(stream, manifest, sinks, self.buffers)  # the other ranks' gathers go on whatever rank 0 does
        return late if sender is None else sender.error

    def _send_pieces(self, accept: Accept, folder: Path | None, manifest: Manifest) -> BaseException | None:
        """Every rank joins its lane of the session and sends its own rows (rank 0 also writes `folder`, if given)."""
        assert self.pieces is not None
        files = SafetensorsSink(folder, len(manifest.buckets)) if folder is not None and self.is_main else None
        try:
            self._join(accept)
            self.pieces.prepare(self.trainer.device)  # the first buckets' casts, while the receivers get ready
            late = self._wait_receivers(accept, manifest.step)
            if late is not None:
                return late
            observers = (self.changes,) if self.changes is not None else ()
            self.pieces.send(self.group, self.trainer.device, files, collect=folder is not None, observers=observers)
        except (RuntimeError, OSError) as e:  # torch.distributed reports a lost peer as RuntimeError/DistBackendError
            close_group(self.group)  # the other members' pending broadcasts fail now instead of at their timeout
            self.group = None
            return e
        return None

    def _wait_receivers(self, accept: Accept, step: int) -> BaseException | None:
        """Wait until every receiver of the session marked that it is about to post its receives of `step`
        (weights/wire/collective.py), watching for the version being taken in another session as `_await_sent` does.
        None when they are all there; the error (the group aborted) otherwise. Counted in `receiver_wait_s`."""
        # one attempt per session: a failed attempt refuses its session, so the next one is sent to a new session
        count, store = accept.world_size - self._senders(), self.store
        assert store is not None  # set by _join
        start = time.perf_counter()
        # polled every 50 us (a store round trip on the host): the first buckets are cast by now (PieceSender.prepare),
        # so their broadcasts start as soon as the last receiver is here
        error = self._watch(step, poll_s=SENT_POLL_S)(lambda: receivers_posted(store, accept.session, step) >= count)
        self.receiver_wait_s += time.perf_counter() - start
        return error

    def _await_sent(self, step: int) -> BaseException | None:
        """CUDA: wait until this rank's broadcasts of `step` have completed, aborting the group if the orchestrator
        took the version in another session meanwhile (weights/send/send_watch.py). gloo's sends have completed
        already."""
        if self.trainer.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.trainer.device))  # it waits for every send of the version
        # polled without sleeping, then every 50 us (a query costs ~1 us): a 1.2 GB version takes ~4 ms on an H200's
        # NVLink, where the default 0.5 ms sleep would add up to an eighth to the send's measured time
        return self._watch(step, poll_s=SENT_POLL_S, spin_s=SENT_SPIN_S)(done.query)

    def _watch(
        self, step: int, poll_s: float = 0.0005, spin_s: float = 0.0
    ) -> Callable[[Callable[[], bool]], BaseException | None]:
        """Waits for a poll of this session's sends of `step` (weights/send/send_watch.py), every `poll_s` (after
        `spin_s` of polling without a sleep): aborts the group if the orchestrator takes the version in another
        session meanwhile, or after SEND_TIMEOUT_S."""
        assert self.session is not None  # set with the group by _join
        watch = SendWatch(self.config.output_dir, step, self.session, SEND_TIMEOUT_S, poll_s=poll_s, spin_s=spin_s)

        def abort() -> None:
            close_group(self.group)  # NCCL: aborting the communicator ends its pending broadcasts
            self.group = None

        return lambda done: watch.wait(done, abort)

    def _shared(self, accept: Accept | None) -> Accept:
        """Rank 0's accepted session, on every rank."""
        if self.trainer.world_size == 1:
            assert accept is not None
            return accept
        box = [accept]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _write_offer(self, folder: Path, manifest: Manifest, probe: dict, shared: dict | None = None) -> None:
        """Create `weights/step_N/` holding the manifest, probe and OFFER marker (atomically); `shared`: the ipc
        transport's buffer handle, in the offer."""
        tmp = folder.parent / f".tmp_{folder.name}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        atomic_write_text(tmp / MANIFEST, manifest.to_json())
        atomic_write_text(tmp / PROBE, _json(probe))
        offer = {"step": manifest.step, "backend": self.transport, "senders": manifest.senders}
        if shared is not None:
            offer["shared"] = shared
        atomic_write_text(tmp / OFFER, _json(offer))
        make_world_readable(tmp)
        commit_dir(tmp, folder)

    def _join(self, accept: Accept) -> None:
        """Use the group of the accepted session, building it (and dropping an older one) when it is new. Senders
        are trainer ranks 0 .. senders - 1 of the group (rank 0 alone when it sends after a gather)."""
        if accept.session == self.session and self.group is not None:
            return
        close_group(self.group)
        self.group = None
        w = self.config.weights
        senders = self._senders()
        if accept.world_size <= senders:
            raise ValueError(
                f"the orchestrator accepted the weights for a group of {accept.world_size} ranks, but the trainer "
                f"sends from {senders}: are trainer and orchestrator of the same Slipstream version?"
            )
        port = w.store_port("the trainer")
        if self.store is None:  # trainer ranks > 0 join rank 0's store
            self.store = open_store(w.master_addr, port, is_master=False, timeout_s=w.accept_timeout_s)
        init = GroupInit(
            self.transport, w.master_addr, port, accept.session, accept.world_size, senders, senders=senders
        )
        self.group = open_group(self.store, init, self.trainer.info.rank, self.trainer.device)
        self.session = accept.session

    def _senders(self) -> int:
        """Trainer ranks that send: every rank its own rows (pieces), or rank 0 after a gather."""
        return self.trainer.world_size if self.pieces is not None else 1

    def _agree(self, ok: bool) -> bool:
        """Whether every rank's part of an attempt succeeded (they all repeat it if one failed)."""
        if self.trainer.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], device=self.trainer.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def close(self) -> None:
        close_group(self.group)
        self.group, self.store = None, None
        if self.shared is not None:  # the last version is on disk (READY): nothing maps the buffer any more
            self.shared.close()
            self.shared = None


@torch.no_grad()
def probe_logprobs(trainer: Trainer) -> dict:
    """{"token_ids", "logprobs"} of the probe in the published dtype. One rank: on a copy cast to that dtype (what
    inference computes). Several ranks: through the sharded policy (a collective; FSDP gathers each block)."""
    token_ids = trainer.probe_token_ids
    if trainer.world_size == 1:
        return {
            "token_ids": token_ids,
            "logprobs": compute_probe_logprobs(
                cast_model(trainer.model, trainer.compute_dtype), token_ids, trainer.policy.head_dtype
            ),
        }
    device = trainer.device
    ids_T = torch.tensor(token_ids, dtype=torch.long, device=device)
    was_training = trainer.policy.training
    trainer.policy.eval()
    try:
        logprobs_T, _ = trainer.policy(
            ids_T, torch.arange(len(token_ids), device=device), torch.ones(len(token_ids), device=device)
        )
    finally:
        trainer.policy.train(was_training)
    return {"token_ids": token_ids, "logprobs": logprobs_T[1:].float().tolist()}


def _json(data: dict) -> str:
    import json

    return json.dumps(data)
