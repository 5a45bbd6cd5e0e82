"""NCCL broadcast of one 512 MiB buffer as 1 op, or cut into N ops (coalesced in one NCCL group, or one by one),
between 2 GPUs: what a broadcast per tensor would cost the weight stream instead of one per bucket.

    python benchmarks/broadcast_ops.py            # needs 2 GPUs; prints one line per case (best of 10 after 3)
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOTAL = 512 << 20
CASES = ((1, False), (16, True), (170, True), (170, False), (680, True))
"""(ops, coalesced): 170 is about a MoE bucket's tensor count at 512 MiB."""


def _broadcast(backend, buf: torch.Tensor, ops: int, coalesced: bool) -> None:
    size = TOTAL // ops
    if coalesced:
        backend._start_coalescing()
    works = []
    for i in range(ops):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        works.append(backend.broadcast([buf[i * size : (i + 1) * size]], opts))
    if coalesced:
        works = [backend._end_coalescing()]
    for work in works:
        work.wait()


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
    buf = torch.empty(TOTAL, dtype=torch.uint8, device="cuda")
    for ops, coalesced in CASES:
        for _ in range(3):
            _broadcast(backend, buf, ops, coalesced)
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            _broadcast(backend, buf, ops, coalesced)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        if rank == 0:
            best = min(times)
            print(f"{ops:4d} ops, coalesced {coalesced!s:5s}: {best * 1e3:.3f} ms, {TOTAL / best / 1e9:.1f} GB/s")
    dist.destroy_process_group()


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("error: needs 2 GPUs", file=sys.stderr)
        return 1
    print(f"# 2 x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {TOTAL >> 20} MiB", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
