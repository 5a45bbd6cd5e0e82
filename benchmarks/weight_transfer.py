"""Weight transfer benchmark (GPU): the trainer's weight stream (trainer/weight_export.py: FSDP shards cast to bf16
and all-gathered a chunk of layers at a time by trainer/shard_gather.py, HF names; each layer copied into reused
dtype-grouped bucket buffers; rank 0 broadcasts each bucket while the next layers are gathered)
into receiver processes running the receive-and-load code of Slipstream's vLLM engine (transport/weight_receiver.py;
"load" copies every tensor into the receiver's own preallocated bf16 parameters, as vLLM's load_weights does).

Scenarios (those that fit the visible GPUs):
- `1to1`: trainer on GPU 0 -> one receiver on GPU 1;
- `fsdp2`: trainer FSDP over GPUs 0-1 -> receivers on GPUs 2 and 3 (NCCL wants one GPU per rank).
Models: Qwen3-0.6B's shape, and Qwen3-30B-A3B's shape cut to 8 layers (random weights; float32 masters as in
training). Reported next to each: raw NCCL broadcast bandwidth of the same group (512 MiB buffer), measured in the same
run, and the filesystem path (the same stream written as safetensors shards, then read and loaded by the receivers).
`transfer_efficiency` = stream GB/s / raw broadcast GB/s; the lowest over all runs is printed last.

    python benchmarks/weight_transfer.py [--scenarios 1to1,fsdp2] [--models qwen3-0.6b,qwen3-30b-a3b-8l] [--bucket-mb 512]
        [--skip-filesystem] [--profile DIR]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from slipstream.utils.net import free_port  # noqa: E402

MODELS = {
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "qwen3-30b-a3b-8l": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
    ),
    # Qwen3-0.6B's tensor count (310) at tiny sizes: the stream's per-tensor host work alone (stream_gather.py)
    "qwen3-28l-tiny": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=28, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True,
    ),
}  # fmt: skip
DEFAULT_MODELS = ("qwen3-0.6b", "qwen3-30b-a3b-8l")
SCENARIOS = {"1to1": (1, 1), "fsdp2": (2, 2)}
"""name -> (trainer ranks, receivers)."""
BUCKET_MB = 512
RAW_BYTES = 512 << 20
"""The raw broadcast baseline's buffer: 512 MiB whatever the bucket size, so a smaller bucket cannot lower the bar."""
RAW_ITERS = 10
REPEATS = 3


def build_model(name: str, device: torch.device, fsdp_mesh=None, layers: int | None = None) -> torch.nn.Module:
    """Our model of that shape (cut to `layers` decoder layers if given) with random float32 weights on `device`
    (FSDP-sharded over `fsdp_mesh` if given, with the trainer's mixed-precision policy)."""
    from transformers import AutoConfig

    from slipstream.models.registry import build_model as build

    spec = dict(MODELS[name])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    hf_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("meta"):
        model = build(hf_config, "custom")
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        from slipstream.parallel.fsdp import build_mp_policy

        policy = build_mp_policy(torch.bfloat16, fsdp_mesh.device_type)  # the trainer's (on GPUs: bf16 gathers)
        for block in model.layers:
            fully_shard(block, mesh=fsdp_mesh, mp_policy=policy)
        fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def sender(rank: int, args: dict, stream, manifest, group, results: dict) -> None:
    """Trainer rank `rank`: raw broadcast baseline, the plan's buckets broadcast bare, the stream into receivers that
    do not load, the stream (each REPEATS times after a warm-up), then the filesystem path."""
    from slipstream.transport.bucket_assembly import BucketBuffers, stream_to
    from slipstream.transport.weight_stream import BroadcastSink, SafetensorsSink, broadcast

    device = torch.device("cuda", torch.cuda.current_device())
    if rank == 0:
        buf = torch.empty(max(RAW_BYTES, *(b.nbytes for b in manifest.buckets)), dtype=torch.uint8, device=device)
        broadcast(group, buf[:RAW_BYTES])  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(RAW_ITERS):
            broadcast(group, buf[:RAW_BYTES])
        torch.cuda.synchronize()
        results["raw_gbps"] = RAW_BYTES * RAW_ITERS / (time.perf_counter() - start) / 1e9
        times = []
        for _ in range(REPEATS + 1):  # the plan's bucket sizes, no assembly, receivers do not load
            start = time.perf_counter()
            for bucket in manifest.buckets:
                broadcast(group, buf[: bucket.nbytes])
            _sync(group)
            times.append(time.perf_counter() - start)
        results["plan_bare_s"] = min(times[1:])
        del buf
    buffers = BucketBuffers()  # kept from one version to the next, as the trainer's publisher does
    for phase in ("stream_noload", "stream"):
        times = []
        for _ in range(REPEATS + 1):  # the first is a warm-up
            _trainer_barrier(args)
            start = time.perf_counter()
            stream_to(stream, manifest, [BroadcastSink(group, device)] if rank == 0 else [], buffers)
            if rank == 0:
                _sync(group)  # every receiver has loaded the last bucket
            times.append(time.perf_counter() - start)
        results[f"{phase}_s"] = min(times[1:])
    if rank == 0:
        results["stream_gbps"] = manifest.nbytes / results["stream_s"] / 1e9
        _time_assembly(stream, manifest, buffers, results)
    if args["profile"]:  # one more version, traced on trainer rank 0 (its collectives need every trainer rank)
        _trainer_barrier(args)
        with _traced(args, "sender" if rank == 0 else None):
            stream_to(stream, manifest, [BroadcastSink(group, device)] if rank == 0 else [], buffers)
            if rank == 0:
                _sync(group)
    if args["skip_filesystem"]:
        return
    folder = Path(args["fs_dir"])
    _trainer_barrier(args)
    start = time.perf_counter()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        stream_to(stream, manifest, [SafetensorsSink(folder, len(manifest.buckets))], buffers)
        os.sync()
        (folder / "READY").write_text("1\n")
        results["fs_write_s"] = time.perf_counter() - start
        _sync(group)  # receivers read and load it
        results["fs_s"] = time.perf_counter() - start
    else:
        stream_to(stream, manifest, [])


class _NullSink:
    """Takes every bucket and sends nothing: what assembling the stream costs alone."""

    def send(self, index, bucket, flat) -> None:
        pass

    def close(self) -> None:
        pass


def _time_assembly(stream, manifest, buffers, results: dict) -> None:
    """One trainer rank only (no FSDP gathers): the stream assembled into the bucket buffers, nothing sent."""
    from slipstream.transport.bucket_assembly import stream_to

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return
    times = []
    for _ in range(REPEATS + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        stream_to(stream, manifest, [_NullSink()], buffers)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    results["assemble_s"] = min(times[1:])


def _traced(args: dict, name: str | None):
    """torch.profiler over the block (CPU and CUDA activity, Python stacks) when `name` is set: the Chrome trace goes
    to `<--profile>/<scenario>-<model>-<name>.json` (benchmarks/trace_gaps.py lists where the GPU waits)."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    if name is None:
        return contextlib.nullcontext()
    path = Path(args["profile"]) / f"{args['scenario']}-{args['model']}-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof = profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        with_stack=True,
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    )
    return prof


def _sync(group) -> None:
    """Returns once every member got here (an all-reduce of one element: the sender cannot finish it early)."""
    flag = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))
    group.allreduce([flag]).wait()
    torch.cuda.synchronize()


def _trainer_barrier(args: dict) -> None:
    if args["num_trainers"] > 1:
        dist.barrier()


def receiver(index: int, args: dict, init, manifest) -> None:
    """Receiver `index`: joins the group, takes the stream REPEATS + 1 times and the folder once, loading each
    tensor into its own preallocated parameters."""
    from slipstream.transport.weight_receiver import WeightReceiver
    from slipstream.transport.weight_stream import broadcast, receive_buckets

    device = torch.device("cuda", torch.cuda.current_device())
    params = {
        t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
        for b in manifest.buckets
        for t in b.tensors
    }

    def load(pairs) -> None:
        for name, tensor in pairs:
            params[name].copy_(tensor, non_blocking=True)

    rx = WeightReceiver(device, rank_in_receivers=index)
    rx.join(init)
    buf = torch.empty(RAW_BYTES, dtype=torch.uint8, device=device)
    for _ in range(RAW_ITERS + 1):
        broadcast(rx.group, buf)
    for _ in range(REPEATS + 1):  # the plan's buckets, bare
        for _pairs in receive_buckets(rx.group, manifest, device):
            pass
        _sync(rx.group)
    del buf
    info = {"step": manifest.step, "manifest": manifest.to_dict()}
    for loader in (lambda pairs: None, load):  # stream_noload, then stream
        for _ in range(REPEATS + 1):
            rx.receive(info, loader)
            _sync(rx.group)
    if args["profile"]:
        with _traced(args, f"receiver{index}" if index == 0 else None):
            rx.receive(info, load)
            _sync(rx.group)
    if args["skip_filesystem"]:
        rx.shutdown()
        return
    folder = Path(args["fs_dir"])
    while not (folder / "READY").exists():
        time.sleep(0.01)
    rx.receive({"step": manifest.step, "path": str(folder)}, lambda pairs: load([(n, t.to(device)) for n, t in pairs]))
    torch.cuda.synchronize()
    _sync(rx.group)
    rx.shutdown()


def worker(rank: int, args: dict, results) -> None:
    from slipstream.trainer.weight_export import HFWeightStream
    from slipstream.transport.collective import GroupInit, open_group, open_store
    from slipstream.transport.weight_stream import Manifest, plan_buckets

    num_trainers, num_receivers = args["num_trainers"], args["num_receivers"]
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    init = GroupInit("nccl", "127.0.0.1", args["store_port"], "bench", 1 + num_receivers)
    mesh = None
    if rank < num_trainers and num_trainers > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args["trainer_port"]))
        dist.init_process_group("nccl", rank=rank, world_size=num_trainers, device_id=device)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (num_trainers,))
    model = build_model(args["model"], device, mesh) if rank < num_trainers else None
    if model is not None:
        stream = HFWeightStream(model, torch.bfloat16)
        metas = stream.metas()
    else:
        stream = None
        metas = HFWeightStream(build_model(args["model"], torch.device("meta")), torch.bfloat16).metas()
    manifest = Manifest(1, tuple(plan_buckets(metas, args["bucket_mb"] << 20)))
    if rank == 0:
        store = open_store("127.0.0.1", args["store_port"], is_master=True, timeout_s=300)
        group = open_group(store, init, 0, device)
        out: dict = {}
        sender(rank, args, stream, manifest, group, out)
        out.update(bytes=manifest.nbytes, num_tensors=manifest.num_tensors, num_buckets=len(manifest.buckets))
        results.update(out)
    elif rank < num_trainers:
        sender(rank, args, stream, manifest, None, {})
    else:
        receiver(rank - num_trainers, args, init, manifest)
    if num_trainers > 1 and rank < num_trainers:
        dist.destroy_process_group()


def run(
    scenario: str, model: str, bucket_mb: int = BUCKET_MB, skip_filesystem: bool = False, profile: str | None = None
) -> dict:
    num_trainers, num_receivers = SCENARIOS[scenario]
    fs_dir = Path(tempfile.mkdtemp(prefix="slipstream-wt-"))
    args = {
        "model": model,
        "num_trainers": num_trainers,
        "num_receivers": num_receivers,
        "store_port": free_port(),
        "trainer_port": free_port(),
        "fs_dir": str(fs_dir / "weights"),
        "bucket_mb": bucket_mb,
        "skip_filesystem": skip_filesystem,
        "profile": profile,
        "scenario": scenario,
    }
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args, results), nprocs=num_trainers + num_receivers, join=True)
        out = dict(results)
    shutil.rmtree(fs_dir, ignore_errors=True)
    out.update(scenario=scenario, model=model, efficiency=out["stream_gbps"] / out["raw_gbps"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="1to1,fsdp2")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument(
        "--skip-filesystem",
        action="store_true",
        help="leave out the filesystem baseline (it takes ~40 s per pass for the MoE shape on a slow disk)",
    )
    parser.add_argument(
        "--bucket-mb", type=int, default=BUCKET_MB, help="bucket size (the trainer's weights.bucket_mb)"
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after the timed runs, trace one more stream version on trainer rank 0 and receiver 0 (Chrome JSON in "
        "DIR, one file per scenario, model and side)",
    )
    cli = parser.parse_args()
    num_gpus = torch.cuda.device_count()
    gpu = torch.cuda.get_device_name(0) if num_gpus else "none"
    print(f"# {num_gpus} x {gpu}, torch {torch.__version__}, bucket {cli.bucket_mb} MiB, bf16", flush=True)
    efficiencies = []
    for scenario in cli.scenarios.split(","):
        if sum(SCENARIOS[scenario]) > num_gpus:
            print(f"# skipping {scenario}: needs {sum(SCENARIOS[scenario])} GPUs, {num_gpus} visible", flush=True)
            continue
        for model in cli.models.split(","):
            r = run(scenario, model, cli.bucket_mb, cli.skip_filesystem, cli.profile)
            efficiencies.append(r["efficiency"])
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
            print(
                f"{scenario:6s} {model:18s} {r['bytes'] / 1e9:6.2f} GB: stream {r['stream_s']:.3f}s "
                f"({r['stream_gbps']:.1f} GB/s) vs raw NCCL broadcast {r['raw_gbps']:.1f} GB/s "
                f"-> efficiency {r['efficiency']:.2f}; "
                + (
                    f"filesystem {r['fs_s']:.2f}s (write {r['fs_write_s']:.2f}s)"
                    if "fs_s" in r
                    else "filesystem skipped"
                ),
                flush=True,
            )
            assemble = f"{r['assemble_s'] * 1e3:.1f} ms" if "assemble_s" in r else "n/a (FSDP)"
            print(
                f"{'':6s} where it goes: plan's buckets bare {r['plan_bare_s'] * 1e3:.1f} ms, assembly alone "
                f"{assemble}, stream without receiver loads {r['stream_noload_s'] * 1e3:.1f} ms, stream "
                f"{r['stream_s'] * 1e3:.1f} ms",
                flush=True,
            )
    if not efficiencies:
        print("error: needs at least 2 GPUs", file=sys.stderr)
        return 1
    print(f"transfer_efficiency: {min(efficiencies):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
