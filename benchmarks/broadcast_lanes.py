"""Bare NCCL broadcast patterns for two trainer ranks sending their pieces to two receivers (4 GPUs: senders 0, 1;
receivers 2, 3), over the bucket sizes of the pieces path's plan for Qwen3-0.6B's shape and a few flat plans: what
the transfer costs before any cast, layout copy or load. Patterns (each bucket's bytes split in two halves, one per
sender, except where one root sends it whole):

- `one_root_4`: rank 0 broadcasts the whole bucket to all 4 ranks (a single sender, for scale);
- `coalesced_4`: both halves in one NCCL group on one communicator of all 4 ranks (the pieces path before lanes);
- `one_by_one_4`: the same two broadcasts one after the other;
- `lanes`: sender q broadcasts its half on its own communicator with the receivers ({0,2,3} and {1,2,3}), side by
  side (weights/wire/collective.py's Lanes: what the pieces path does now);
- `p2p`: each sender sends its half to each receiver (batched isend/irecv);
- `one_root_3`, `one_root_2`: one root, the whole bucket, to {0,2,3} / {0,2} (the floor of one sender).

    python benchmarks/broadcast_lanes.py        # needs 4 GPUs; best of 10 after a warm-up, barrier included
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MB = 1 << 20


def plans() -> dict[str, list[int]]:
    from weight_transfer import BUCKET_MB, EDGE_MB, build_model

    from slipstream.weights.send.export import HFWeightStream
    from slipstream.weights.wire.stream import plan_pipelined

    metas = HFWeightStream(build_model("qwen3-0.6b", torch.device("meta")), torch.bfloat16).metas()
    sizes = [b.nbytes for b in plan_pipelined(metas, BUCKET_MB * MB, EDGE_MB * MB)]
    return {
        "qwen3-0.6b plan": sizes,
        "512 MiB x 1": [512 * MB],
        "128 MiB x 10": [128 * MB] * 10,
        "32 MiB x 10": [32 * MB] * 10,
    }


def worker(rank: int, port: int, cases: dict[str, list[int]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=4, device_id=dev)
    world = dist.group.WORLD
    g023, g123, g02 = dist.new_group([0, 2, 3]), dist.new_group([1, 2, 3]), dist.new_group([0, 2])
    buf = torch.empty(max(sum(s) for s in cases.values()) + MB, dtype=torch.uint8, device=dev)

    def bcast(group, t, root):
        return dist.broadcast(t, src=root, group=group, async_op=True)

    def one_root_4(sizes):
        for n in sizes:
            bcast(world, buf[:n], 0).wait()

    def coalesced_4(sizes):
        for n in sizes:
            with dist._coalescing_manager(group=world, device=dev, async_ops=True) as cm:
                bcast(world, buf[: n // 2], 0)
                bcast(world, buf[n // 2 : n], 1)
            cm.wait()

    def one_by_one_4(sizes):
        for n in sizes:
            bcast(world, buf[: n // 2], 0).wait()
            bcast(world, buf[n // 2 : n], 1).wait()

    def lanes(sizes):
        for n in sizes:  # each group's broadcasts run on its own NCCL stream: side by side
            works = []
            if rank != 1:
                works.append(bcast(g023, buf[: n // 2], 0))
            if rank != 0:
                works.append(bcast(g123, buf[n // 2 : n], 1))
            for w in works:
                w.wait()

    def p2p(sizes):
        for n in sizes:
            halves = (buf[: n // 2], buf[n // 2 : n])
            if rank < 2:
                ops = [dist.P2POp(dist.isend, halves[rank], r) for r in (2, 3)]
            else:
                ops = [dist.P2POp(dist.irecv, halves[q], q) for q in (0, 1)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def one_root_3(sizes):
        for n in sizes if rank != 1 else ():
            bcast(g023, buf[:n], 0).wait()

    def one_root_2(sizes):
        for n in sizes if rank in (0, 2) else ():
            bcast(g02, buf[:n], 0).wait()

    patterns = (one_root_4, coalesced_4, one_by_one_4, lanes, p2p, one_root_3, one_root_2)
    for pattern in patterns:
        for case, sizes in cases.items():
            times = []
            for _ in range(11):
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                pattern(sizes)
                torch.cuda.synchronize()
                dist.barrier()
                times.append(time.perf_counter() - start)
            if rank == 0:
                best = min(times[1:])
                print(f"{pattern.__name__:13s} {case:16s} {best * 1e3:7.3f} ms {sum(sizes) / best / 1e9:6.1f} GB/s")
    dist.destroy_process_group()


def main() -> int:
    if torch.cuda.device_count() < 4:
        print("needs 4 GPUs", file=sys.stderr)
        return 1
    from slipstream.utils.net import free_port

    cases = plans()
    print(
        f"# {torch.cuda.get_device_name(0)} x 4, torch {torch.__version__}; 0.6B plan (MiB): "
        f"{[round(n / MB, 1) for n in cases['qwen3-0.6b plan']]}"
    )
    mp.spawn(worker, args=(free_port(), cases), nprocs=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
