"""The ordering behind a gloo rank's SIGABRT at exit ("terminate called without an active exception"), forced: a
group that outlives the rank's work (FSDP keeps the trainer's default group alive past destroy_process_group), whose
worker thread lets go of the last collective's tensor only once the interpreter is shutting down. Letting go of a
tensor that Python already dropped takes the GIL; a thread that takes it during shutdown is made to exit, and the
process aborts. Here the rank polls the collective's result while keeping the GIL (no thread switch), so the worker
thread is still waiting for it when the rank ends: most runs that end with a plain return abort (not all: the worker
thread gets through whenever something on the way out lets go of the GIL before the interpreter starts shutting down).

    python -m tests.distributed.gloo_exit_race [-n RUNS]    # how many runs abort: plain return vs the benchmark's exit

tests/distributed/test_weight_transfer_bench.py runs the benchmark's way out (benchmarks/weight_transfer.py's
`leave`) through it."""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.utils.net import free_port
from tests.benchmark_scripts import load_benchmark

KEPT: list = []
"""The rank's default group, referenced past its work as FSDP's state references the trainer's."""


class _ReleasesTheGilAtShutdown:
    """Dropped with this module's globals, so once the interpreter is shutting down: sleeping lets another thread take
    the GIL, as destroying a group or a store there does."""

    def __del__(self, sleep=time.sleep) -> None:
        sleep(0.1)


def late_release_rank(rank: int, port: int, leave: bool) -> None:
    bench_leave = load_benchmark("weight_transfer").leave  # loaded first: reading it would let the worker thread in
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    KEPT.append(dist.group.WORLD)
    store = dist.distributed_c10d._get_default_store()
    KEPT.append(_ReleasesTheGilAtShutdown())
    sys.setswitchinterval(1e4)  # this thread keeps the GIL until it blocks; a thread waiting for it never asks
    if rank == 1:
        time.sleep(0.3)  # a slow peer: rank 0's collective is still in flight when rank 0 drops its tensor
    tensor = torch.ones(1)
    result = tensor.view(-1).numpy()  # the same bytes through another tensor, read without releasing the GIL
    dist.all_reduce(tensor, async_op=True)  # its work dropped at once: the gloo worker thread holds the only reference
    del tensor  # ... and so the tensor's: letting go of it now takes the GIL
    while result[0] != 2.0:  # the result is in: the worker thread then lets go of the work, and waits for the GIL
        pass
    if leave:
        bench_leave(store, rank, 2)


def run(leave: bool) -> str | None:
    """One 2-rank run; the failure (a rank's exit signal) or None."""
    try:
        mp.spawn(late_release_rank, args=(free_port(), leave), nprocs=2, join=True)
    except mp.ProcessExitedException as e:
        return str(e)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.distributed.gloo_exit_race", description=__doc__)
    parser.add_argument("-n", type=int, default=8, help="runs of each way out")
    args = parser.parse_args()
    for leave in (False, True):
        failures = [f for f in (run(leave) for _ in range(args.n)) if f is not None]
        way = "the benchmark's leave()" if leave else "plain return"
        print(f"{way}: {len(failures)}/{args.n} runs aborted {sorted(set(failures))}", flush=True)


if __name__ == "__main__":
    main()
