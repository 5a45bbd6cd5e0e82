"""Weight transfer benchmark (GPU): the trainer's weight stream, both ways `slipstream rl` sends it, into receiver
processes running the receive-and-load code of Slipstream's vLLM engine (weights/receive/receiver.py). Their loader
copies every tensor into the receiver's own preallocated bf16 parameters, one `copy_` per tensor as vLLM's
load_weights goes; as in the engine, the first version's loads are recorded into a copy plan
(weights/receive/copy_plan.py) and later versions replay it (`stream`: one fused copy per bucket). `stream_tensorloads`
is the same stream with every version loaded tensor by tensor, `stream_noload` with receivers that do not load. Each is
the best of REPEATS versions after a warm-up; the receiver's host times of the last version (`receiver0_pieces_host_ms`:
start, first bucket loaded, last bucket loaded, done, in ms) and the sender's (`pieces_*_sender_host_ms`: its work
queued) show whether a host falls behind its GPU.
- `pieces` (what the trainer uses when the model's sharding allows, weights/send/piece_send.py): every trainer rank
  casts its own rows of each bucket into a reused buffer and broadcasts them on its own lane (a group of it and the
  receivers); receivers replay the copy plan straight from the buffer the pieces arrived in (`--lay-out`: lay the
  bucket out whole first, as the loader's first version does); the bucket plan ramps up from and down to
  `--edge-mb` (the trainer's weights.edge_bucket_mb); the first buckets are cast before the receivers are ready, as
  the trainer casts them while it waits for vLLM's workers (`--no-prepare`: inside the clock, as before);
- `gather` (the fallback, weights/send/export.py): FSDP shards cast to bf16 and all-gathered a chunk of layers at a
  time by weights/send/shard_gather.py, each layer copied into reused dtype-grouped bucket buffers, rank 0 broadcasting
  each bucket while the next layers are gathered.

Scenarios (those that fit the visible GPUs):
- `1to1`: trainer on GPU 0 -> one receiver on GPU 1;
- `fsdp2`: trainer FSDP over GPUs 0-1 -> receivers on GPUs 2 and 3 (NCCL wants one GPU per rank).
Models: Qwen3-0.6B's shape, and Qwen3-30B-A3B's shape cut to 8 layers (random weights; float32 masters as in
training). Reported next to each: raw NCCL broadcast bandwidth from trainer rank 0 to the receivers (512 MiB buffer),
measured in the same run, and the filesystem path (the same stream written as safetensors shards, then read and
loaded by the receivers). `transfer_efficiency` = stream GB/s / that raw broadcast GB/s; the lowest over all runs of
the path the trainer takes (`pieces`) is printed last.

    python benchmarks/weight_transfer.py [--scenarios 1to1,fsdp2] [--models qwen3-0.6b,qwen3-30b-a3b-8l] [--bucket-mb 512]
        [--edge-mb 32] [--paths pieces,gather] [--skip-filesystem] [--lay-out] [--no-prepare] [--profile DIR]
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
EDGE_MB = 32
"""The trainer's default weights.edge_bucket_mb: the pieces path's plan ramps up from and down to buckets of this size
(plan_pipelined); 0: the gather path's plan (plan_buckets, the model's order)."""
PATHS = ("pieces", "gather")
RAW_BYTES = 512 << 20
"""The raw broadcast baseline's buffer: 512 MiB whatever the bucket size, so a smaller bucket cannot lower the bar."""
RAW_ITERS = 10
REPEATS = 10
PHASES = ("stream_noload", "stream_tensorloads", "stream")
"""Receivers: not loading; loading tensor by tensor; replaying the copy plan recorded at the phase's warm-up."""
DEVICE_TYPE = "cuda"
"""`--device cpu` runs every path on gloo ranks (a smoke run of this benchmark's code; its figures mean nothing)."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE_TYPE == "cuda" else torch.device("cpu")


def _synchronize() -> None:
    if DEVICE_TYPE == "cuda":
        torch.cuda.synchronize()


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


def _raw(group, nbytes: int, results: dict, prefix: str = "") -> None:
    """Rank 0 of `group`: the raw broadcast baseline (RAW_ITERS broadcasts of RAW_BYTES after a warm-up)."""
    from slipstream.weights.wire.stream import broadcast

    device = _device()
    buf = torch.empty(max(RAW_BYTES, nbytes), dtype=torch.uint8, device=device)
    broadcast(group, buf[:RAW_BYTES])  # warm-up
    _synchronize()
    start = time.perf_counter()
    for _ in range(RAW_ITERS):
        broadcast(group, buf[:RAW_BYTES])
    _synchronize()
    results[f"{prefix}raw_gbps"] = RAW_BYTES * RAW_ITERS / (time.perf_counter() - start) / 1e9


def sender_pieces(rank: int, args: dict, pieces, manifest, group, results: dict) -> None:
    """Trainer rank `rank` sends its own rows of each bucket (every trainer rank is a sender): raw broadcast
    baseline of this group (rank 0), the stream into receivers that do not load, then the stream."""
    device = _device()
    if rank == 0:
        _raw(_lane0(group), 0, results, "pieces_")
    for phase in PHASES:
        times = []
        for _ in range(REPEATS + 1):  # the first is a warm-up
            _trainer_barrier(args)
            if args["prepare"]:
                pieces.prepare(device)  # the publisher casts these while it waits for the receivers
            _sync(group)  # the receivers are ready (they NaN-fill their parameters before a checked version)
            start = time.perf_counter()
            pieces.send(group, device)
            queued = time.perf_counter()
            _sync(group)  # every receiver has loaded the last bucket
            times.append(time.perf_counter() - start)
        results[f"pieces_{phase}_s"] = min(times[1:])
        if rank == 0:  # host time of the last version's send (its GPU work queued), in ms
            results[f"pieces_{phase}_sender_host_ms"] = round((queued - start) * 1e3, 3)
    if args["profile"]:
        _trainer_barrier(args)
        _sync(group)
        with _traced(args, "pieces-sender" if rank == 0 else None):
            pieces.send(group, device)
            _sync(group)
    if rank == 0:
        results["pieces_stream_gbps"] = manifest.nbytes / results["pieces_stream_s"] / 1e9


def _receive_raw(group) -> None:
    """A member of `group` other than rank 0: takes part in the raw baseline's broadcasts."""
    from slipstream.weights.wire.stream import broadcast

    buf = torch.empty(RAW_BYTES, dtype=torch.uint8, device=_device())
    for _ in range(RAW_ITERS + 1):
        broadcast(group, buf)


def sender(rank: int, args: dict, stream, manifest, group, results: dict) -> None:
    """Trainer rank `rank`, rank 0 sending after a gather: raw broadcast baseline, the plan's buckets broadcast bare,
    the stream into receivers that do not load, the stream (each REPEATS times after a warm-up), then the filesystem
    path."""
    from slipstream.weights.wire.bucket_assembly import BucketBuffers, stream_to
    from slipstream.weights.wire.stream import BroadcastSink, SafetensorsSink, broadcast

    device = _device()
    if rank == 0:
        _raw(group, 0, results)
        buf = torch.empty(max(b.nbytes for b in manifest.buckets), dtype=torch.uint8, device=device)
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
    for phase in PHASES:
        times = []
        for _ in range(REPEATS + 1):  # the first is a warm-up
            _trainer_barrier(args)
            if rank == 0:
                _sync(group)  # the receivers are ready
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
        if rank == 0:
            _sync(group)
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
    from slipstream.weights.wire.bucket_assembly import stream_to

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return
    times = []
    for _ in range(REPEATS + 1):
        _synchronize()
        start = time.perf_counter()
        stream_to(stream, manifest, [_NullSink()], buffers)
        _synchronize()
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
    """Returns once every member got here (an all-reduce of one element: the sender cannot finish it early); with
    several senders, on each lane in turn (a sender's own lane: no sender starts before every receiver is ready)."""
    from slipstream.weights.wire.collective import Lanes

    flag = torch.ones(1, device=_device())
    for g in group.held() if isinstance(group, Lanes) else [group]:
        g.allreduce([flag]).wait()
    _synchronize()


def _lane0(group):
    """The group of trainer rank 0 and every receiver: the session's group, or lane 0 with several senders."""
    from slipstream.weights.wire.collective import Lanes

    return group.groups[0] if isinstance(group, Lanes) else group


def _trainer_barrier(args: dict) -> None:
    if args["num_trainers"] > 1:
        dist.barrier()


def receiver(index: int, args: dict, inits: dict, manifests: dict, results) -> None:
    """Receiver `index`: for each path, joins its group and takes the stream REPEATS + 1 times without loading and
    as many times loading each tensor into its own preallocated parameters (and, after a gather, the folder once).
    With both paths, the parameters each left are compared bit for bit (`receiver<i>_paths_agree`)."""
    from slipstream.weights.receive.receiver import WeightReceiver

    device = _device()
    manifest = manifests["gather"]
    params = {
        t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
        for b in manifest.buckets
        for t in b.tensors
    }

    def load(pairs) -> None:
        for name, tensor in pairs:
            params[name].copy_(tensor, non_blocking=True)

    loaded_by: dict[str, dict[str, torch.Tensor]] = {}
    for path in args["paths"]:
        for p in params.values():
            p.fill_(float("nan"))  # a tensor the path leaves out cannot keep the other path's values
        if path == "pieces":
            rx = WeightReceiver(device, rank_in_receivers=index)
            rx.join(inits["pieces"])
            _receive_raw(_lane0(rx.group))
            trace = f"pieces-receiver{index}" if index == 0 else None
            exact, host_ms, wire_loads = _receive_stream(rx, manifests["pieces"], load, params, args, trace)
            results[f"receiver{index}_pieces_plan_exact"] = exact
            results[f"receiver{index}_pieces_wire_loads"] = wire_loads
            results[f"receiver{index}_pieces_host_ms"] = host_ms
            rx.shutdown()
        else:
            results[f"receiver{index}_gather_plan_exact"] = _receive_gathered(
                index, args, inits["gather"], manifest, load, params
            )
        loaded_by[path] = {n: p.clone() for n, p in params.items()}
    if len(loaded_by) == 2:
        a, b = loaded_by.values()
        results[f"receiver{index}_paths_agree"] = all(
            torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a
        )


def _receive_stream(rx, manifest, load, params: dict, args: dict, trace: str | None) -> tuple[bool, dict, int]:
    """The stream REPEATS + 1 times for each of PHASES, then (--profile) once traced, loading by the copy plan.
    Parameters are NaN-filled before every replayed version. Returns whether the replays left exactly the bytes the
    tensor-by-tensor loads did, the host times of each phase's last version (ms: start, first bucket loaded, last
    bucket loaded, done), and how many buckets the last replayed version loaded straight from the wire buffer."""
    from slipstream.weights.receive.copy_plan import PlannedLoads

    info = {"step": manifest.step, "manifest": manifest.to_dict()}
    loads = PlannedLoads()  # recorded at its phase's warm-up, as the engine records the first version

    def planned(pairs) -> None:
        if loads.replaying():
            loads.replay(pairs)
            return
        with loads.call(pairs):
            load(pairs)

    marks: list[float] = []

    def direct(bucket, wire) -> bool:
        """Several senders: replay the plan straight from the wire buffer (as the engine does)."""
        if not loads.replay_wire(tuple(t.name for t in bucket.tensors), bucket.layout, wire):
            return False
        marks.append(time.perf_counter())
        wired[0] += 1
        return True

    wired = [0]

    def timed(loader):
        def call(pairs) -> None:
            loader(pairs)
            marks.append(time.perf_counter())

        return call

    def receive(loader, phase: str) -> None:
        if loader is planned and loads.plan is not None:
            for p in params.values():
                p.fill_(float("nan"))  # a replay that misses a byte cannot keep the loads' value
        _sync(rx.group)  # the sender starts its clock now
        marks.clear()
        wired[0] = 0
        t0 = time.perf_counter()
        if loader is planned:
            loads.start(params.values)  # inside the clock, as the engine's start_weight_update
        t1 = time.perf_counter()
        rx.receive(info, timed(loader), direct if loader is planned and not args["lay_out"] else None)
        t2 = time.perf_counter()
        if loader is planned:
            loads.end(params.values())
        _sync(rx.group)
        host[phase] = [round((t - t0) * 1e3, 3) for t in (t1, marks[0], marks[-1], t2)]

    loaded, host = {}, {}
    for phase, loader in zip(PHASES, (lambda pairs: None, load, planned), strict=True):
        for _ in range(REPEATS + 1):
            receive(loader, phase)
        if loader is load:
            loaded = {n: p.clone() for n, p in params.items()}
    if loads.plan is None or loads.replays != REPEATS:
        raise RuntimeError(f"the receiver's loads were not replayed from a copy plan: {loads.refused}")
    exact = all(torch.equal(loaded[n].view(torch.uint8), p.view(torch.uint8)) for n, p in params.items())
    host_ms = dict(host)  # before a traced version, if any, overwrites the last one
    wire_loads = wired[0]
    if args["profile"]:
        with _traced(args, trace):
            receive(planned, "stream")
    return exact, host_ms, wire_loads


def _receive_gathered(index: int, args: dict, init, manifest, load, params: dict) -> bool:
    from slipstream.weights.receive.bucket_receive import receive_buckets
    from slipstream.weights.receive.receiver import WeightReceiver

    device = _device()
    rx = WeightReceiver(device, rank_in_receivers=index)
    rx.join(init)
    _receive_raw(rx.group)
    for _ in range(REPEATS + 1):  # the plan's buckets, bare
        for _pairs in receive_buckets(rx.group, manifest, device):
            pass
        _sync(rx.group)
    exact, _, _ = _receive_stream(rx, manifest, load, params, args, f"receiver{index}" if index == 0 else None)
    if args["skip_filesystem"]:
        rx.shutdown()
        return exact
    folder = Path(args["fs_dir"])
    while not (folder / "READY").exists():
        time.sleep(0.01)
    rx.receive({"step": manifest.step, "path": str(folder)}, lambda pairs: load([(n, t.to(device)) for n, t in pairs]))
    _synchronize()
    _sync(rx.group)
    rx.shutdown()
    return exact


def worker(rank: int, args: dict, results) -> None:
    from slipstream.weights.send.export import HFWeightStream
    from slipstream.weights.send.piece_send import PieceSender
    from slipstream.weights.wire.collective import GroupInit, close_group, open_group, open_store
    from slipstream.weights.wire.stream import Manifest, plan_buckets, plan_pipelined

    num_trainers, num_receivers = args["num_trainers"], args["num_receivers"]
    global DEVICE_TYPE, RAW_BYTES
    DEVICE_TYPE = args["device"]
    if DEVICE_TYPE == "cpu":
        RAW_BYTES = 8 << 20  # a smoke run: no need to push 5.6 GB through loopback
    backend = "nccl" if DEVICE_TYPE == "cuda" else "gloo"
    if DEVICE_TYPE == "cuda":
        torch.cuda.set_device(rank)
    device = _device()
    buffers = args["receive_buffers"]
    init = GroupInit(backend, "127.0.0.1", args["store_port"], "bench", 1 + num_receivers, receive_buffers=buffers)
    pieces_init = GroupInit(
        backend, "127.0.0.1", args["store_port"], "pieces", num_trainers + num_receivers, num_trainers,
        senders=num_trainers, receive_buffers=buffers,
    )  # fmt: skip
    inits = {"gather": init, "pieces": pieces_init}
    mesh = None
    if rank < num_trainers and num_trainers > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args["trainer_port"]))
        device_id = device if DEVICE_TYPE == "cuda" else None
        dist.init_process_group(backend, rank=rank, world_size=num_trainers, device_id=device_id)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(DEVICE_TYPE, (num_trainers,))
    model = build_model(args["model"], device, mesh) if rank < num_trainers else None
    if model is not None:
        stream = HFWeightStream(model, torch.bfloat16)
        metas = stream.metas()
    else:
        stream = None
        metas = HFWeightStream(build_model(args["model"], torch.device("meta")), torch.bfloat16).metas()
    manifest = Manifest(1, tuple(plan_buckets(metas, args["bucket_mb"] << 20)))
    store = open_store("127.0.0.1", args["store_port"], is_master=rank == 0, timeout_s=300)
    if rank < num_trainers:
        out: dict = {}
        piece_plan = manifest.buckets
        if args["edge_mb"]:  # the pieces path may send in any order: buckets shaped for the pipeline
            piece_plan = tuple(plan_pipelined(metas, args["bucket_mb"] << 20, args["edge_mb"] << 20))
        pieces = PieceSender(stream, piece_plan, rank, num_trainers)
        if rank == 0:  # the receivers learn the rows table from the manifest, as from an offer
            store.set("pieces_manifest", pieces.manifest(1).to_json())
        for path in args["paths"]:
            if path == "pieces":
                group = open_group(store, pieces_init, rank, device)
                sender_pieces(rank, args, pieces, manifest, group, out)
                close_group(group)
            else:
                group = open_group(store, init, 0, device) if rank == 0 else None
                sender(rank, args, stream, manifest, group, out)
                close_group(group)
        if rank == 0:
            out.update(bytes=manifest.nbytes, num_tensors=manifest.num_tensors, num_buckets=len(manifest.buckets))
            out.update(pieces_num_buckets=len(piece_plan))
            results.update(out)
    else:
        import json

        manifests = {"gather": manifest, "pieces": Manifest.from_dict(json.loads(store.get("pieces_manifest")))}
        receiver(rank - num_trainers, args, inits, manifests, results)
    if num_trainers > 1 and rank < num_trainers:
        dist.destroy_process_group()
    leave(store, rank, num_trainers + num_receivers)


def leave(store, rank: int, world_size: int) -> None:
    """End this rank's process once every rank is done (none leaves while a peer may still need its groups, and rank
    0, which hosts the store, last), skipping the interpreter's shutdown. FSDP keeps the trainer ranks' gloo group
    alive past destroy_process_group, so its worker threads outlive the work; one still letting go of its last
    collective's tensors takes the GIL, and if the interpreter is shutting down by then, the process aborts
    ("terminate called without an active exception", SIGABRT; pytorch#190489). The results are in the manager."""
    store.add(f"finished/{rank}", 1)
    store.wait([f"finished/{r}" for r in range(world_size)])
    if rank == 0:
        store.wait([f"left/{r}" for r in range(1, world_size)])
    else:
        store.set(f"left/{rank}", "1")  # unanswered: rank 0 may be gone as soon as the store has it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(
    scenario: str,
    model: str,
    bucket_mb: int = BUCKET_MB,
    skip_filesystem: bool = False,
    profile: str | None = None,
    paths: tuple[str, ...] = PATHS,
    device: str = "cuda",
    edge_mb: int = EDGE_MB,
    lay_out: bool = False,
    prepare: bool = True,
    receive_buffers: int = 2,
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
        "edge_mb": edge_mb,
        "skip_filesystem": skip_filesystem,
        "profile": profile,
        "scenario": scenario,
        "paths": paths,
        "device": device,
        "lay_out": lay_out,
        "prepare": prepare,
        "receive_buffers": receive_buffers,
    }
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args, results), nprocs=num_trainers + num_receivers, join=True)
        out = dict(results)
    shutil.rmtree(fs_dir, ignore_errors=True)
    out.update(scenario=scenario, model=model)
    for path, prefix in (("gather", ""), ("pieces", "pieces_")):
        if path in paths:
            out[f"{prefix}efficiency"] = out[f"{prefix}stream_gbps"] / out[f"{prefix}raw_gbps"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="1to1,fsdp2")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument(
        "--paths",
        default=",".join(PATHS),
        help="pieces: every trainer rank sends its own rows (the trainer's path); gather: rank 0 sends after a gather",
    )
    parser.add_argument(
        "--skip-filesystem",
        action="store_true",
        help="leave out the filesystem baseline (it takes ~40 s per pass for the MoE shape on a slow disk)",
    )
    parser.add_argument(
        "--bucket-mb", type=int, default=BUCKET_MB, help="bucket size (the trainer's weights.bucket_mb)"
    )
    parser.add_argument(
        "--edge-mb",
        type=int,
        default=EDGE_MB,
        help="pieces path: buckets ramp up from and down to this size, large tensors mid-stream (the trainer's "
        "weights.edge_bucket_mb); 0: the gather path's plan",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after the timed runs, trace one more stream version on trainer rank 0 and receiver 0 (Chrome JSON in "
        "DIR, one file per scenario, model and side)",
    )
    parser.add_argument(
        "--lay-out",
        action="store_true",
        help="fsdp2 pieces: receivers lay each bucket out whole before replaying the copy plan (as before replays read "
        "the wire buffer)",
    )
    parser.add_argument(
        "--no-prepare",
        action="store_true",
        help="pieces path: cast the first buckets inside the clock (the trainer casts them while it waits for the "
        "receivers: weights/send/piece_send.py PieceSender.prepare)",
    )
    parser.add_argument(
        "--receive-buffers",
        type=int,
        default=2,
        help="bucket buffers per receiver (weights.receive_buffers): its receives are posted that far ahead",
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo ranks, a smoke run (figures mean nothing)"
    )
    cli = parser.parse_args()
    num_gpus = torch.cuda.device_count() if cli.device == "cuda" else 4
    gpu = torch.cuda.get_device_name(0) if cli.device == "cuda" and num_gpus else "CPU (gloo)"
    ramp = f" (pieces path: edges {cli.edge_mb} MiB)" if cli.edge_mb else ""
    print(f"# {num_gpus} x {gpu}, torch {torch.__version__}, bucket {cli.bucket_mb} MiB{ramp}, bf16", flush=True)
    efficiencies = []
    for scenario in cli.scenarios.split(","):
        if sum(SCENARIOS[scenario]) > num_gpus:
            print(f"# skipping {scenario}: needs {sum(SCENARIOS[scenario])} GPUs, {num_gpus} visible", flush=True)
            continue
        for model in cli.models.split(","):
            paths = tuple(cli.paths.split(","))
            r = run(
                scenario,
                model,
                cli.bucket_mb,
                cli.skip_filesystem,
                cli.profile,
                paths,
                cli.device,
                cli.edge_mb,
                cli.lay_out,
                not cli.no_prepare,
                cli.receive_buffers,
            )
            efficiencies.append(r["pieces_efficiency" if "pieces" in paths else "efficiency"])
            print(
                json.dumps(
                    {k: round(v, 6 if k.endswith("_s") else 4) if isinstance(v, float) else v for k, v in r.items()}
                ),
                flush=True,
            )
            if "pieces" in paths:
                print(
                    f"{scenario:6s} {model:18s} {r['bytes'] / 1e9:6.2f} GB: pieces stream {r['pieces_stream_s']:.4f}s "
                    f"({r['pieces_stream_gbps']:.1f} GB/s; receivers not loading {r['pieces_stream_noload_s'] * 1e3:.1f}"
                    f" ms, loading tensor by tensor {r['pieces_stream_tensorloads_s'] * 1e3:.1f} ms) vs raw NCCL "
                    f"broadcast {r['pieces_raw_gbps']:.1f} GB/s -> efficiency {r['pieces_efficiency']:.2f}",
                    flush=True,
                )
            if "gather" not in paths:
                continue
            agree = [r[k] for k in sorted(r) if k.endswith("_paths_agree")]
            print(f"{'':6s} every receiver got the same bytes by both paths: {all(agree)} ({len(agree)} receivers)")
            exact = [r[k] for k in sorted(r) if k.endswith("_plan_exact")]
            print(f"{'':6s} copy-plan replays left the bytes of tensor-by-tensor loads: {all(exact)} ({len(exact)})")
            print(
                f"{scenario:6s} {model:18s} {r['bytes'] / 1e9:6.2f} GB: gather stream {r['stream_s']:.4f}s "
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
                f"{assemble}, stream without receiver loads {r['stream_noload_s'] * 1e3:.1f} ms, loading tensor by "
                f"tensor {r['stream_tensorloads_s'] * 1e3:.1f} ms, stream {r['stream_s'] * 1e3:.1f} ms",
                flush=True,
            )
    if not efficiencies:
        print("error: needs at least 2 GPUs", file=sys.stderr)
        return 1
    print(f"transfer_efficiency: {min(efficiencies):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
