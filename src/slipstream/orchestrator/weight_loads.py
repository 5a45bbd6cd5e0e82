"""How the orchestrator has inference take one weight version, through vLLM's weight-transfer API: from its folder
on disk, by broadcast from the trainer (the trainer offered it and waits; see weights/wire/offers.py), or from
the trainer's shared memory (the ipc transport: the offer names the buffer; DELIVERED, written here once inference
copied it, frees the buffer for the next version).

A broadcast needs a transfer session: the group of the trainer's sending ranks (rank 0, or every rank when each
sends its own rows; the offer says how many) and every inference worker. One is opened at the
first broadcast and again whenever inference is a new instance (a restart loses the group); the session id is sent
to the workers in /init_weight_transfer_engine and to the trainer in the version's ACCEPT marker.
"""

import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.config.weights import WeightsConfig
from slipstream.orchestrator.client import InferenceClient, WeightLoad
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

    async def load(self, version: int, before_resume=None) -> WeightLoad:
        """Have inference take `version` (in-flight requests frozen meanwhile; see InferenceClient.load_weights)."""
        if self.lora_name is not None:
            if not is_ready(self.output_dir, version):
                raise FileNotFoundError(f"{weights_dir(self.output_dir, version)} is not complete on disk (READY)")
            link = serving_link(self.output_dir, self.lora_name)
            target = weights_dir(self.output_dir, version).resolve()
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
            return await self.client.load_weights(version, info, before_resume=before_resume)
        offer = read_offer(self.output_dir, version)
        if offer["backend"] == "ipc":  # the trainer's memory, mapped by the engine; no session, nothing to accept
            info = {"step": version, "manifest": read_manifest(self.output_dir, version), "shared": offer.get("shared")}
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
            return await self.client.load_weights(
                version, info, init_info=init_info, on_paused=accept, before_resume=before_resume
            )
        except BaseException:
            self.session = None  # the group may be broken: the next broadcast opens a new session
            raise

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
