"""Process groups between the trainer (rank 0, the sender) and inference workers (ranks 1..n), outside any default
process group: a TCPStore hosted by the trainer, one PrefixStore per session, and a gloo (CPU) or NCCL (GPU) group.
When several trainer ranks send (each its own rows: weights/wire/pieces.py), each sender gets its own group with every
receiver, a *lane* (`Lanes`), so that the senders' pieces travel side by side on separate communicators.

A session is one life of the receiving side: when an inference server restarts, the orchestrator opens a new session
and both sides build a fresh group under its prefix, on the same store.

Before each version's broadcasts the senders wait until every receiver said, on the store, that it is about to post
its receives (`mark_posted`, `receivers_posted`): an NCCL send completes only with its receive, so a broadcast started
while vLLM's workers are still on their way to /update_weights (the API server's loop can be 100-300 ms late) holds
the link idle, and the trainer's timing of the send would count that wait as transfer. (A receiver that marked only
after queuing its first receive hung the first version on 2 x H200: NCCL connects a group's peers at its first
broadcast, from inside the call, so the receiver's host waited there for a sender that waited for its mark.)
"""

import datetime
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupInit:
    """How a receiver joins the sender's group (sent as `init_info` through vLLM's /init_weight_transfer_engine)."""

    backend: str
    master_addr: str
    master_port: int
    session: str
    world_size: int
    """Sender + every receiving worker."""
    rank_offset: int = 1
    """Rank of the first receiving worker (the sender is rank 0)."""
    timeout_s: float = 600.0
    senders: int = 1
    """Trainer ranks that send, ranks 0 .. senders - 1 (each its own rows). With more than one, every member joins
    the lanes it belongs to (`Lanes`) instead of one group of every rank."""
    receive_buffers: int = 2
    """Bucket buffers each receiver receives into (weights.receive_buffers): it posts the receives of that many
    buckets minus one ahead of the bucket it loads."""

    def __post_init__(self) -> None:
        for name, kind in (("master_addr", str), ("session", str), ("master_port", int), ("world_size", int)):
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool) or value in ("", 0):
                raise ValueError(
                    f"weight transfer init_info: {name!r} must be a non-empty {kind.__name__}, got {value!r}"
                )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"weight transfer init_info: master_port {self.master_port} is not a TCP port")
        if not isinstance(self.rank_offset, int) or isinstance(self.rank_offset, bool) or self.rank_offset < 1:
            raise ValueError(
                f"weight transfer init_info: rank_offset must be an integer >= 1, got {self.rank_offset!r}"
            )
        if (
            not isinstance(self.timeout_s, int | float)
            or isinstance(self.timeout_s, bool)
            or not 0 < self.timeout_s < 1e9
        ):
            raise ValueError(
                f"weight transfer init_info: timeout_s must be a number of seconds > 0, got {self.timeout_s!r}"
            )
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"weight transfer backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.world_size < 2:
            raise ValueError(
                f"a weight transfer group needs the sender and >= 1 receiver (world_size {self.world_size})"
            )
        if (
            not isinstance(self.senders, int)
            or isinstance(self.senders, bool)
            or not 1 <= self.senders <= self.rank_offset
        ):
            raise ValueError(
                f"weight transfer init_info: senders must be an integer from 1 to rank_offset ({self.rank_offset}), "
                f"got {self.senders!r}"
            )
        if (
            not isinstance(self.receive_buffers, int)
            or isinstance(self.receive_buffers, bool)
            or self.receive_buffers < 2
        ):
            raise ValueError(
                f"weight transfer init_info: receive_buffers must be an integer >= 2, got {self.receive_buffers!r}"
            )
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"weight transfer init_info: rank_offset {self.rank_offset} >= world_size {self.world_size}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def _posted_key(session: str, step: int) -> str:
    return f"slipstream/posted/{session}/{step}"


def mark_posted(store: dist.Store, session: str, step: int) -> None:
    """A receiver of `session` is about to post its receives of version `step` (the senders wait for it)."""
    store.add(_posted_key(session, step), 1)


def receivers_posted(store: dist.Store, session: str, step: int) -> int:
    """How many receivers of `session` marked version `step` (`mark_posted`) so far."""
    return store.add(_posted_key(session, step), 0)


def open_store(addr: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: hosted by the sender (is_master), joined by receivers."""
    return dist.TCPStore(
        addr, port, None, is_master=is_master, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


@dataclass(frozen=True)
class Lanes:
    """One member's groups of a session with several senders. Lane q is sender q's own group: sender q is its rank 0,
    the receivers (ranks senders .. world_size - 1 of the session) its ranks 1 ... A receiver is in every lane, a
    sender in its own only (None for the others). On one communicator of every rank, two senders' pieces (one NCCL
    group per bucket) took 4.2-4.9 ms for the buckets of Qwen3-0.6B's shape on 4 x H200, against 3.95-4.04 ms on a
    lane per sender (benchmarks/broadcast_lanes.py, benchmarks/RESULTS.md)."""

    groups: "tuple[dist.ProcessGroup | None, ...]"

    def held(self) -> "list[dist.ProcessGroup]":
        """The lanes this member belongs to, in sender order."""
        return [g for g in self.groups if g is not None]


def open_group(store: dist.Store, init: GroupInit, rank: int, device: torch.device) -> "dist.ProcessGroup | Lanes":
    """Join the session as `rank` (blocks until every rank of each group joined, at most init.timeout_s): its one
    group, or with several senders the lanes of `rank` (a receiver joins them in sender order; no deadlock, since each
    sender joins only its own)."""
    if init.senders == 1:
        return _open(store, init, init.session, rank, init.world_size, device)
    lanes = []
    for q in range(init.senders):
        if rank < init.senders and rank != q:
            lanes.append(None)
            continue
        lane_rank = 0 if rank == q else rank - init.senders + 1
        lanes.append(
            _open(store, init, f"{init.session}/lane{q}", lane_rank, init.world_size - init.senders + 1, device)
        )
    return Lanes(tuple(lanes))


def _open(store: dist.Store, init: GroupInit, name: str, rank: int, world_size: int, device: torch.device):
    timeout = datetime.timedelta(seconds=init.timeout_s)
    prefixed = dist.PrefixStore(f"slipstream/{name}/", store)
    if init.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if device.type != "cuda":
        raise ValueError("the nccl weight transfer needs CUDA devices on both sides; use gloo on CPU")
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    # Connect now, so the first broadcast is not also the (slow, all-ranks) communicator set-up.
    group.eager_connect_single_device(device)
    return group


def close_group(group: "dist.ProcessGroup | Lanes | None") -> None:
    """Release a group or every lane (a dead peer's group is unusable); safe on None. NCCL groups are aborted: a clean
    shutdown finalizes the communicator together with the peers, which would wait for receivers that keep their
    group."""
    if group is None:
        return
    if isinstance(group, Lanes):
        for lane in group.held():
            close_group(lane)
        return
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
    release = group.abort if nccl is not None and isinstance(group, nccl) else group.shutdown
    try:
        release()
    except RuntimeError:
        pass  # a group whose peer died may refuse; it is dropped either way
