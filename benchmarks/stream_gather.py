"""The sender's side without the send: how long an FSDP-sharded trainer takes to produce its weight stream in
bfloat16 (every rank gathers; rank 0 also assembles the 512 MiB buckets, as before a broadcast; nothing is sent),
with the chunked all-gather of weights/send/shard_gather.py and with the per-layer
FSDP unsharding it replaces, measured in the same run on the same model. GPUs (NCCL, one rank per GPU, the trainer's
mixed-precision policy: FSDP gathers bfloat16) or CPU ranks (gloo; FSDP gathers float32 there).

    python benchmarks/stream_gather.py --device cuda --world 2 --model qwen3-0.6b
    python benchmarks/stream_gather.py --device cpu --world 2 --model qwen3-0.6b --layers 8

Prints per variant the best of `--repeats` after a warm-up, and `gather_speedup: <x>` (unsharding time / chunked
gather time) last. `--profile PATH` also writes a torch.profiler trace of three chunked-gather versions (rank 0) to
PATH.json, for `benchmarks/trace_gaps.py`.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_transfer import BUCKET_MB, MODELS, _NullSink, build_model  # noqa: E402

from slipstream.utils.net import free_port  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def worker(rank: int, args: dict, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from slipstream.weights.send.export import HFWeightStream
    from slipstream.weights.wire.bucket_assembly import BucketBuffers, stream_to
    from slipstream.weights.wire.stream import Manifest, plan_buckets

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args["port"]))
    if args["device"] == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=args["world"], device_id=device)
    else:
        torch.set_num_threads(args["threads"])
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=args["world"])
    mesh = init_device_mesh(device.type, (args["world"],))
    model = build_model(args["model"], device, mesh, args["layers"])
    streams = {
        "unshard_per_layer": HFWeightStream(model, torch.bfloat16, gather=False),
        "chunked_gather": HFWeightStream(model, torch.bfloat16),
    }
    manifests = {n: Manifest(1, tuple(plan_buckets(s.metas(), BUCKET_MB << 20))) for n, s in streams.items()}
    buffers = {name: BucketBuffers() for name in streams}  # kept from one version to the next, as the publisher does
    out = {
        "bytes": streams["chunked_gather"].num_bytes,
        "collectives": streams["chunked_gather"].gatherer.num_collectives,
    }
    out["layer_groups"] = len(streams["chunked_gather"].plan)
    for _ in range(2):  # interleaved, twice, so drift on a shared machine hits both
        for name, stream in streams.items():
            times = []
            for _ in range(args["repeats"] + 1):  # the first is a warm-up
                _sync(device)
                start = time.perf_counter()
                stream_to(stream, manifests[name], [_NullSink()] if rank == 0 else [], buffers[name])
                _sync(device)
                times.append(time.perf_counter() - start)
            out[f"{name}_s"] = min(out.get(f"{name}_s", float("inf")), *times[1:])
    if args["profile"]:
        _profile(rank, device, streams["chunked_gather"], manifests["chunked_gather"], buffers["chunked_gather"], args)
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def _profile(rank: int, device: torch.device, stream, manifest, buffers, args: dict) -> None:
    """Three more chunked-gather versions under torch.profiler (CPU and CUDA activity, Python stacks); rank 0 writes
    the Chrome trace to `<--profile>.json` (benchmarks/trace_gaps.py lists where the GPU waits)."""
    from torch.profiler import ProfilerActivity, profile

    from slipstream.weights.wire.bucket_assembly import stream_to

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(3):
            stream_to(stream, manifest, [_NullSink()] if rank == 0 else [], buffers)
            _sync(device)
    if rank == 0:
        prof.export_chrome_trace(f"{args['profile']}.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to this many decoder layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    parser.add_argument(
        "--profile", default=None, help="after timing, profile 3 chunked-gather versions; rank 0 writes PROFILE.json"
    )
    cli = parser.parse_args()
    if cli.device == "cuda" and torch.cuda.device_count() < cli.world:
        print(
            f"error: --world {cli.world} needs {cli.world} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr
        )
        return 1
    hardware = f"{cli.world} x {torch.cuda.get_device_name(0)}" if cli.device == "cuda" else f"{cli.world} CPU ranks"
    print(f"# {hardware}, torch {torch.__version__}, {cli.model}, layers {cli.layers or 'all'}", flush=True)
    args = vars(cli) | {"port": free_port()}
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args, results), nprocs=cli.world, join=True)
        r = dict(results)
    print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    gb = r["bytes"] / 1e9
    for name in ("unshard_per_layer", "chunked_gather"):
        print(f"{name:18s} {r[f'{name}_s'] * 1e3:9.1f} ms  ({gb / r[f'{name}_s']:.1f} GB/s of bf16 stream)")
    print(f"gather_speedup: {r['unshard_per_layer_s'] / r['chunked_gather_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
