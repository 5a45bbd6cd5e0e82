"""The receiving end of the weight stream, shared by Slipstream's vLLM weight-transfer engine, the simulated
inference server and the transfer benchmark: join the sender's group, then take one version at a time either from
the broadcast or from a published folder on disk, handing each bucket of (name, tensor) pairs to a loader."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slipstream.weights.receive.bucket_receive import DirectLoader, ReceiveBuffers, receive_buckets
from slipstream.weights.receive.delta_receive import DeltaMirror, DeltaStats, receive_delta
from slipstream.weights.wire.collective import GroupInit, close_group, mark_posted, open_group, open_store
from slipstream.weights.wire.published import INCOMPLETE_MARKER
from slipstream.weights.wire.shared_buffer import bucket_offsets, open_shared
from slipstream.weights.wire.stream import Manifest, iter_safetensors, unpack

Loader = Callable[[list[tuple[str, torch.Tensor]]], object]
"""Loads one batch of (HF name, tensor) pairs into the model (vLLM: `model.load_weights`)."""

FILE_BATCH_BYTES = 256 << 20
"""Tensors read from disk are handed to the loader in batches of about this many bytes."""


@dataclass
class ReceiveStats:
    step: int
    num_tensors: int
    num_bytes: int
    seconds: float
    source: str
    """"broadcast", "shared memory" or the folder read."""
    names: frozenset[str] = frozenset()
    """Every tensor of the version (what the loader must have been handed)."""
    delta: DeltaStats | None = None
    """A delta-encoded broadcast: what it carried."""
    host_s: float | None = None
    """A broadcast: seconds from the receiver's mark (it is about to post its receives, weights/wire/collective.py)
    until its host had queued the loads of the last bucket. On CUDA the receives and loads run on after that, so
    `seconds` adds the wait for the GPU: host_s close to the time after the mark says the receiver's host (Python,
    vLLM's loader) set the pace, a short host_s that the wire or the GPU did."""
    marked_s: float | None = None
    """A broadcast: seconds from the start of `receive` to the receiver's mark (its own set-up before it receives)."""
    load_s: float | None = None
    """A broadcast: the part of host_s spent in the loader's calls (queuing each bucket's loads into the model); the
    rest is the receives' own host work (posting them, waiting for free buffers)."""

    def to_dict(self) -> dict:
        data = {
            "step": self.step,
            "num_tensors": self.num_tensors,
            "num_bytes": self.num_bytes,
            "seconds": round(self.seconds, 4),
            "source": self.source,
        }
        if self.host_s is not None and self.marked_s is not None:
            data |= {"marked_s": round(self.marked_s, 4), "host_s": round(self.host_s, 4)}
        if self.load_s is not None:
            data["load_s"] = round(self.load_s, 4)
        if self.delta is not None:
            data["delta"] = self.delta.to_dict()
        return data


class WeightReceiver:
    """One inference worker's receiving side. `rank_in_receivers` is the worker's index among all receiving
    workers (data-parallel index x workers per replica + worker rank)."""

    def __init__(self, device: torch.device, rank_in_receivers: int = 0) -> None:
        self.device = device
        self.rank_in_receivers = rank_in_receivers
        self.init: GroupInit | None = None
        self.group = None
        self.store = None
        self.buffers = ReceiveBuffers(device)
        """Bucket buffers kept from one version to the next: the session's `receive_buffers` (2 by default) of the
        largest bucket (with several senders, as many more once a bucket has to be laid out whole)."""
        self.mirror = DeltaMirror(device)
        """Delta updates: the last version's buckets (weights/receive/delta_receive.py), for this session only."""

    def join(self, init: GroupInit) -> None:
        """Join the sender's group of `init.session` (blocks until the sender and every receiver joined)."""
        self.shutdown()
        rank = init.rank_offset + self.rank_in_receivers
        if not 0 < rank < init.world_size:
            raise ValueError(f"receiver rank {rank} outside the group of {init.world_size} (sender is rank 0)")
        self.store = open_store(init.master_addr, init.master_port, is_master=False, timeout_s=init.timeout_s)
        self.group = open_group(self.store, init, rank, self.device)
        self.init = init
        self.buffers.resize(init.receive_buffers)

    def receive(
        self,
        update_info: dict,
        load: Loader,
        direct: DirectLoader | None = None,
        buffers: ReceiveBuffers | None = None,
    ) -> ReceiveStats:
        """Take one version: `{"step": N, "path": folder}` reads the published folder's safetensors (READY marker
        required); `{"step": 0, "model": folder}` the model's own checkpoint folder (the initial weights, no marker);
        `{"step": N, "manifest": {...}}` receives the manifest's buckets from the sender's broadcast, or with
        `"shared": handle` reads them from the trainer's shared buffer. `direct` may load a bucket of several
        senders' pieces straight from its wire buffer (weights/receive/bucket_receive.py); `load` gets every other
        one. `buffers`: where a plain broadcast lands instead of the receiver's own reused ones (staging keeps
        a buffer per bucket, weights/receive/staging.py, and as many wire buffers as the receiver's own)."""
        start = time.perf_counter()
        delta = marked_s = host_s = None
        load_s = 0.0
        step = update_info.get("step") if isinstance(update_info, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"update_info must be an object with an integer 'step' >= 0 (got {update_info!r:.200})")
        if "path" in update_info:
            if not isinstance(update_info["path"], str) or not update_info["path"]:
                raise ValueError(f"update_info 'path' must be a folder path, got {update_info['path']!r:.200}")
            names, num_bytes = _load_folder(Path(update_info["path"]), load)
            source = str(update_info["path"])
        elif "model" in update_info:
            if step != 0 or not isinstance(update_info["model"], str) or not update_info["model"]:
                raise ValueError(f"update_info 'model' needs step 0 and a folder path (got {update_info!r:.200})")
            names, num_bytes = _load_folder(Path(update_info["model"]), load, published=False)
            source = str(update_info["model"])
        elif "manifest" in update_info:
            manifest = Manifest.from_dict(update_info["manifest"])
            if manifest.step != step:
                raise ValueError(f"update_info step {step} but its manifest is of step {manifest.step}")
            if "shared" in update_info:  # the ipc transport: the trainer's buffer, mapped (wire/shared_buffer.py)
                _load_shared(update_info["shared"], manifest, self.device, load)
                source = "shared memory"
            else:
                if self.group is None:
                    raise RuntimeError(
                        "weights arrive by broadcast but this worker has not joined the sender's group: call "
                        "/init_weight_transfer_engine first"
                    )
                assert self.store is not None and self.init is not None  # set with the group by join
                mark_posted(self.store, self.init.session, step)  # the senders start once every receiver is here
                marked = time.perf_counter()
                if manifest.delta:
                    delta = DeltaStats()
                    buckets = receive_delta(self.group, manifest, self.mirror, delta)
                else:
                    into = buffers if buffers is not None else self.buffers
                    buckets = receive_buckets(self.group, manifest, self.device, into, direct)
                for pairs in buckets:
                    loading = time.perf_counter()
                    load(pairs)
                    load_s += time.perf_counter() - loading
                marked_s, host_s = marked - start, time.perf_counter() - marked
                source = "broadcast"
            names, num_bytes = {t.name for b in manifest.buckets for t in b.tensors}, manifest.nbytes
        else:
            raise ValueError(f"update_info needs 'path', 'model' or 'manifest' (got keys {sorted(update_info)})")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        return ReceiveStats(
            step,
            len(names),
            num_bytes,
            seconds,
            source,
            frozenset(names),
            delta,
            host_s,
            marked_s,
            load_s if host_s is not None else None,
        )

    def shutdown(self) -> None:
        self.buffers.release()
        self.mirror.release()
        close_group(self.group)
        self.group, self.store, self.init = None, None, None


def _load_shared(handle: dict, manifest: Manifest, device: torch.device, load: Loader) -> None:
    """Hand `load` each bucket of `manifest`, read in place from the shared buffer `handle` names."""
    flat = open_shared(handle, device)
    offsets, total = bucket_offsets([b.nbytes for b in manifest.buckets])
    if total > flat.numel():
        raise ValueError(f"the shared weights buffer holds {flat.numel()} bytes, the manifest needs {total}")
    for offset, bucket in zip(offsets, manifest.buckets, strict=True):
        load(unpack(flat[offset : offset + bucket.nbytes], bucket))


def _load_folder(folder: Path, load: Loader, published: bool = True) -> tuple[set[str], int]:
    """Feed a folder's tensors to `load` in batches; return (their names, bytes). `published`: a version the trainer
    wrote, complete only with its READY marker (a model's own checkpoint has none)."""
    if published and not (folder / "READY").exists():
        raise FileNotFoundError(f"{folder} is not a complete published weights folder (no READY marker)")
    batch: list[tuple[str, torch.Tensor]] = []
    names: set[str] = set()
    batch_bytes = num_bytes = 0
    for name, tensor in iter_safetensors(folder):
        batch.append((name, tensor))
        names.add(name)
        size = tensor.numel() * tensor.element_size()
        batch_bytes, num_bytes = batch_bytes + size, num_bytes + size
        if batch_bytes >= FILE_BATCH_BYTES:
            load(batch)
            batch, batch_bytes = [], 0
    if batch:
        load(batch)
    return names, num_bytes


def check_loaded(stats: ReceiveStats, loaded: set[str]) -> None:
    """Raise if some tensor of the version was never handed to the model's loader (a bucket dropped on the way in):
    the model would serve a mix of versions that the probe may not tell from bf16's noise."""
    missing = stats.names - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise RuntimeError(
            f"slipstream {INCOMPLETE_MARKER}: version {stats.step} arrived whole ({len(stats.names)} tensors) but "
            f"{len(missing)} never reached the model's loader ({shown}{', ...' if len(missing) > 5 else ''}); "
            "inference serves a mix of versions"
        )
