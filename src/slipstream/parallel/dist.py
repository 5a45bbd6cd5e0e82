"""Process-group setup for torchrun (RANK / WORLD_SIZE / LOCAL_RANK) and the few collectives the trainer needs;
every helper is a no-op with a single rank and no process group."""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""Collective timeout: a rank waiting longer than this for its peers fails instead of hanging."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits among the trainer's ranks."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0 writes metrics, published weights and checkpoint commit markers."""
        return self.rank == 0


def read_rank_info() -> RankInfo:
    """RANK, WORLD_SIZE and LOCAL_RANK from the environment (torchrun sets them); one rank when unset."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size}); start the trainer with torchrun")
    return RankInfo(rank, world_size, local_rank)


def rank_device(device_type: str, info: RankInfo) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK on GPUs (one GPU per rank), else the CPU."""
    if device_type != "cuda":
        return torch.device(device_type)
    if info.local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"LOCAL_RANK={info.local_rank} but this node has {torch.cuda.device_count()} GPU(s); "
            "start at most one trainer rank per GPU"
        )
    return torch.device("cuda", info.local_rank)


def init_distributed(info: RankInfo, device: torch.device, timeout: timedelta = DEFAULT_TIMEOUT) -> bool:
    """Join the default process group when there are several ranks (nccl on GPUs, gloo on CPU). Returns whether
    this call created it (the caller then destroys it); an existing group of the right size is reused."""
    if info.world_size == 1:
        return False
    if dist.is_initialized():
        if dist.get_world_size() != info.world_size:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks exists, WORLD_SIZE={info.world_size}")
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout)
    return True


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; returns `tensor`."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(value: int, device: torch.device) -> int:
    """Largest `value` over ranks."""
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())
