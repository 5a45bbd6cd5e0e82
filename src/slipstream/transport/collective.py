"""Process groups between the trainer (rank 0, the sender) and inference workers (ranks 1..n), outside any default
process group: a TCPStore hosted by the trainer, one PrefixStore per session, and a gloo (CPU) or NCCL (GPU) group.

A session is one life of the receiving side: when an inference server restarts, the orchestrator opens a new session
and both sides build a fresh group under its prefix, on the same store.
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
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"weight transfer init_info: rank_offset {self.rank_offset} >= world_size {self.world_size}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def open_store(addr: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: hosted by the sender (is_master), joined by receivers."""
    return dist.TCPStore(
        addr, port, None, is_master=is_master, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def open_group(store: dist.Store, init: GroupInit, rank: int, device: torch.device) -> "dist.ProcessGroup":
    """Join the session's group as `rank` (blocks until every rank has joined, at most init.timeout_s)."""
    timeout = datetime.timedelta(seconds=init.timeout_s)
    prefixed = dist.PrefixStore(f"slipstream/{init.session}/", store)
    if init.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, init.world_size, timeout)
    if device.type != "cuda":
        raise ValueError("the nccl weight transfer needs CUDA devices on both sides; use gloo on CPU")
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(prefixed, rank, init.world_size, options)
    # Connect now, so the first broadcast is not also the (slow, all-ranks) communicator set-up.
    group.eager_connect_single_device(device)
    return group


def close_group(group: "dist.ProcessGroup | None") -> None:
    """Release a group (a dead peer's group is unusable); safe on None. NCCL groups are aborted: a clean shutdown
    finalizes the communicator together with the peers, which would wait for receivers that keep their group."""
    if group is None:
        return
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
    release = group.abort if nccl is not None and isinstance(group, nccl) else group.shutdown
    try:
        release()
    except RuntimeError:
        pass  # a group whose peer died may refuse; it is dropped either way
