"""How the orchestrator has inference take one weight version, through vLLM's weight-transfer API: from its folder
on disk, by broadcast from the trainer (the trainer offered it and waits; see weights/wire/offers.py), or from
the trainer's shared memory (the ipc transport: the offer names the buffer; DELIVERED, written here once inference
copied it, frees the buffer for the next version).

A broadcast needs a transfer session: the group of the trainer's sending ranks (rank 0, or every rank when each
sends its own rows; the offer says how many) and every inference worker. One is opened at the
first broadcast and again whenever inference is a new instance (a restart loses the group); the session id is sent
to the workers in /init_weight_transfer_engine and to the trainer in the version's ACCEPT marker.

With `weights.no_stall`, a broadcast of an open session loads without pausing inference (InferenceClient.
load_weights_staged): the workers stage it while vLLM generates, the orchestrator waits for the trainer's DELIVERED
marker without blocking vLLM, then the swap. A new session's version (the first broadcast, a restarted server) still
loads paused: the workers must join the group first (/init_weight_transfer_engine blocks until every rank joined), and
a server that just (re)started has no rollouts to keep going. So do versions loaded from disk.
"""

import asyncio
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.config.weights import WeightsConfig
from slipstream.orchestrator.client import InferenceClient, WeightLoad
from slipstream.rollout.client import InferenceUnavailable
from slipstream.utils.fs import fsync_dir
from slipstream.weights.wire.offers import (
    Accept,
    is_delivered,
    is_offered,
    mark_delivered,
    read_manifest,
    read_offer,
    write_accept,
)
from slipstream.weights.wire.published import is_ready, weights_dir

DELIVERED_POLL_S = 0.01
"""How often a no-stall update looks for the trainer's DELIVERED marker while the workers stage the version."""
SERVING_DIR = "serving"
"""`<output_dir>/serving/<adapter name>`: a symbolic link to the adapter version inference serves (LoRA runs)."""


@dataclass
class TransferSession:
    session: str
    instance: str | None
    """The inference instance (X-Slipstream-Instance) whose workers joined it."""
    world_size: int
    senders: int = 1
    """Trainer ranks that send (group ranks 0 .. senders - 1); the workers follow."""


@dataclass
class WeightLoader:
    """Loads versions on one inference server: picks disk or broadcast per version, keeps the transfer session."""

    client: InferenceClient
    output_dir: Path
    weights: WeightsConfig
    session: TransferSession | None = field(default=None)
    lora_name: str | None = None
    """With model.lora: versions are LoRA adapter folders, served under this model name (version 0 is the base
    model itself, whose adapter is zero)."""

    def by_broadcast(self, version: int) -> bool:
        """Whether `version` must come by broadcast: offered, not yet delivered (then it is not on disk yet)."""
        return is_offered(self.output_dir, version) and not is_delivered(self.output_dir, version)

    async def load(self, version: int, before_resume=None, on_stall=None) -> WeightLoad:
        """Have inference take `version` (in-flight requests frozen meanwhile; see InferenceClient.load_weights, or
        with `weights.no_stall` only for the swap: load_weights_staged). `on_stall` is called right before inference
        stops generating (the pause, or the swap); `before_resume` once the version is loaded, before generation
        goes on with it (a staged update: right when the swap returns)."""
        on_stall = on_stall or (lambda: None)
        if self.lora_name is not None:
            if not is_ready(self.output_dir, version):
                raise FileNotFoundError(f"{weights_dir(self.output_dir, version)} is not complete on disk (READY)")
            link = serving_link(self.output_dir, self.lora_name)
            target = weights_dir(self.output_dir, version).resolve()
            on_stall()
            return await self.client.load_lora_adapter(
                self.lora_name, str(link), before_resume=before_resume, on_paused=lambda: point_link(link, target)
            )
        if not self.by_broadcast(version):
            if not is_ready(self.output_dir, version):
                raise FileNotFoundError(
                    f"{weights_dir(self.output_dir, version)} is neither complete on disk (READY) nor offered by the "
                    "trainer for broadcast; it cannot be loaded"
                )
            info = {"step": version, "path": str(weights_dir(self.output_dir, version))}
            on_stall()
            return await self.client.load_weights(version, info, before_resume=before_resume)
        offer = read_offer(self.output_dir, version)
        if offer["backend"] == "ipc":  # the trainer's memory, mapped by the engine; no session, nothing to accept
            info = {"step": version, "manifest": read_manifest(self.output_dir, version), "shared": offer.get("shared")}
            on_stall()
            load = await self.client.load_weights(version, info, before_resume=before_resume)
            mark_delivered(self.output_dir, version, "ipc")  # the trainer may write its buffer again
            return load
        init_info = await self._maybe_new_session(offer)
        session = self.session
        assert session is not None  # set by _maybe_new_session

        def accept() -> None:
            write_accept(self.output_dir, version, Accept(session.session, session.world_size))

        info = {"step": version, "manifest": read_manifest(self.output_dir, version)}
        try:
            if self.weights.no_stall and init_info is None:
                load = await self.client.load_weights_staged(
                    version, info, accept, lambda: self._wait_delivered(version), on_stall
                )
                if before_resume is not None:
                    before_resume()  # tokens arriving from now on are stamped `version` (rollout/streaming.py)
                return load
            on_stall()
            return await self.client.load_weights(
                version, info, init_info=init_info, on_paused=accept, before_resume=before_resume
            )
        except BaseException:
            self.session = None  # the group may be broken: the next broadcast opens a new session
            raise

    async def _wait_delivered(self, version: int) -> None:
        """Until the trainer marks `version` DELIVERED (its sends complete, a delta's repair round included: the
        workers hold the version by then, or their staging failed, which the swap raises). InferenceUnavailable if
        inference is lost meanwhile; TimeoutError after `weights.accept_timeout_s` (a trainer whose send failed waits
        for the version to be accepted again and never marks it)."""
        deadline = time.monotonic() + self.weights.accept_timeout_s
        while not is_delivered(self.output_dir, version):
            if not self.client.available:
                raise InferenceUnavailable(
                    f"inference was lost while staging version {version} ({self.client.unavailable_reason})"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {self.weights.accept_timeout_s:g}s (weights.accept_timeout_s) for the trainer to mark "
                    f"version {version} DELIVERED ({weights_dir(self.output_dir, version)}) while inference staged it; "
                    "its broadcast did not complete: see the trainer's log"
                )
            await asyncio.sleep(DELIVERED_POLL_S)

    async def _maybe_new_session(self, offer: dict) -> dict[str, Any] | None:
        """init_info of a new session when there is none for the current inference instance (or the trainer's
        `offer` comes from another number of senders), else None."""
        senders = offer["senders"]
        session = self.session
        if session is not None and session.instance == self.client.instance and session.senders == senders:
            return None
        world_size = senders + await self.client.get_world_size()
        self.session = TransferSession(uuid.uuid4().hex, self.client.instance, world_size, senders)
        return {
            "backend": offer["backend"],
            "master_addr": self.weights.master_addr,
            "master_port": self.weights.store_port("the orchestrator's weight transfer"),
            "session": self.session.session,
            "world_size": world_size,
            "rank_offset": senders,
            "senders": senders,
            "timeout_s": 600.0,
            "receive_buffers": self.weights.receive_buffers,
        }


def serving_link(output_dir: Path, name: str) -> Path:
    """The stable path a LoRA adapter is served from: vLLM keeps the path of the load a request started under and,
    for an adapter loaded in place, reads that path again at every engine step while the request runs, so requests in
    flight across an update would load the version they started with back over the new one. With every version
    served from one path (this link, switched while inference is paused), any re-read gets the current version."""
    return Path(output_dir).resolve() / SERVING_DIR / re.sub(r"[^A-Za-z0-9._-]", "_", name)


def point_link(link: Path, target: Path) -> None:
    """Make `link` a symbolic link to `target`, atomically (a new link renamed over the old one)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp, target_is_directory=True)
    os.replace(tmp, link)
    fsync_dir(link.parent)
