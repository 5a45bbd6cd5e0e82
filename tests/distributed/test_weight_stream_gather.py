"""The weight stream of a sharded model (gloo ranks) sends the same bytes whichever way its shards are gathered:
chunks of layers cast and all-gathered together (weights/send/shard_gather.py), or each layer's FSDP unit unsharded in
float32 and cast in the bucket copy. After a training step and a forward (which leave the root's FSDP unit
unsharded), for dense and MoE models (experts sharded by FSDP, by EP alone and by both), transformers' model, HSDP,
tensors kept in float32, one chunk and one chunk per layer. Also checks how many collectives the chunked gather
issues, and uneven shards (rows not divisible by the ranks)."""

import pytest
import torch

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import ParallelConfig, TrainerConfig
from slipstream.weights.send.shard_gather import rows_per_rank
from tests.distributed.helpers import BatchedRanks, CollectBuckets, selected_params, write_step_batches

CASES = {
    # name: (family, impl, world size, parallel, whether every sharded tensor takes the chunked gather)
    "qwen3-custom-fsdp2": ("qwen3", "custom", 2, ParallelConfig(), True),
    "qwen3-hf-fsdp2": ("qwen3", "hf", 2, ParallelConfig(), True),
    "qwen3_moe-custom-fsdp2": ("qwen3_moe", "custom", 2, ParallelConfig(), True),
    "qwen3_moe-custom-ep2": ("qwen3_moe", "custom", 2, ParallelConfig(ep=2), True),
    "qwen3_moe-custom-fsdp2-ep2": ("qwen3_moe", "custom", 4, ParallelConfig(ep=2), False),  # experts: full_tensor()
    "qwen3-custom-hsdp": ("qwen3", "custom", 4, ParallelConfig(dp_replicate=2), True),
}

NOT_DIRECT = {"qwen3_moe-custom-fsdp2-ep2", "qwen3-custom-hsdp"}
"""Cases whose trainer ranks cannot each send their own rows (weights/send/piece_send.py): experts sharded twice;
HSDP."""

KEEP_IN_FP32 = {"qwen3-custom-fsdp2": ("q_norm",)}
"""Cases whose model publishes these (sharded) tensors in float32: their gathers travel in float32."""


def stream_both_ways(
    model_dir: str,
    impl: str,
    parallel: ParallelConfig,
    keep_in_fp32: tuple[str, ...],
    output_dir,
    result_path,
    device: str = "cpu",
) -> None:
    """Every rank: set up the trainer, stream its model in bfloat16 with the chunked gather (one chunk; one chunk per
    layer group) and with per-layer unsharding; rank 0 saves the buckets of each and the gatherers' statistics.
    `keep_in_fp32` names tensors published in float32 (as a family's `keep_in_fp32` does)."""
    import torch.distributed as dist

    from slipstream.trainer.setup import setup_trainer, teardown_trainer
    from slipstream.trainer.step import train_step
    from slipstream.transport.rollouts import batch_path, read_batch
    from slipstream.weights.send.export import HFWeightStream
    from slipstream.weights.send.publish import probe_logprobs
    from slipstream.weights.wire.bucket_assembly import stream_to
    from slipstream.weights.wire.stream import Manifest, plan_buckets

    config = TrainerConfig(
        model=ModelConfig(name=model_dir),
        model_impl=impl,
        output_dir=output_dir,
        max_steps=1,
        parallel=parallel,
        device=device,
        num_threads=1,
    )
    trainer = setup_trainer(config)
    if keep_in_fp32:
        trainer.model.keep_in_fp32 = keep_in_fp32
    with torch.no_grad():  # distinct values in every tensor, so a misplaced row cannot go unnoticed
        for i, param in enumerate(trainer.model.parameters()):
            param.add_(0.01 * (i + 1))
    # Built before training, as the publisher builds its stream (building one takes the model's state dict, which
    # reshards FSDP units).
    variants = {"one_chunk": {}, "chunk_per_layer": {"chunk_bytes": 1}, "unshard": {"gather": False}}
    streams = {name: HFWeightStream(trainer.model, torch.bfloat16, **kwargs) for name, kwargs in variants.items()}
    plan = streams["unshard"].plan
    sharded = {(k, i): _is_dtensor(entry) for k, group in enumerate(plan) for i, entry in enumerate(group)}
    # A training step and the probe's forward, as before every publish: they leave the root unit's parameters
    # unsharded, which the stream takes as they are.
    batch = read_batch(batch_path(output_dir, 1, trainer.data_rank))
    c = config
    train_step(trainer.policy, trainer.optimizer, batch, c.loss, 1.0, trainer.device, trainer.autocast_dtype)
    probe_logprobs(trainer)
    whole = sum(not _is_dtensor(entry) for group in plan for entry in group)
    results = {"pieces_root_unsharded": send_pieces(streams["unshard"], trainer.device)}
    for name, stream in streams.items():  # the per-layer unsharding last: it reshards the root when done
        manifest = Manifest(1, tuple(plan_buckets(stream.metas(), 1 << 15)))
        sink = CollectBuckets()
        stream_to(stream, manifest, [sink] if dist.get_rank() == 0 else [])
        gatherer = stream.gatherer
        results[name] = {
            "buckets": [sink.buckets[i].cpu() for i in sorted(sink.buckets)],
            "collectives": None if gatherer is None else gatherer.num_collectives,
            "chunks": None if gatherer is None else len(gatherer.chunks),
            "groups": len(stream.plan),
            "whole": whole,
            "all_gathered": gatherer is not None
            and all(gatherer.is_gathered(*key) == was_sharded for key, was_sharded in sharded.items()),
        }
    results["pieces"] = send_pieces(streams["unshard"], trainer.device)  # every FSDP unit resharded now
    if dist.get_rank() == 0:
        torch.save(results, result_path)
    teardown_trainer(trainer)


def send_pieces(stream, device: torch.device) -> dict:
    """Every rank sends its own rows (weights/send/piece_send.py) on its own lane (no receivers here: a lane of that
    rank alone; gloo, NCCL on CUDA), and rank 0 collects every bucket whole over the trainer's group, as on checkpoint
    steps. {"not_direct": why} for a model that cannot be sent so."""
    import torch.distributed as dist

    from slipstream.weights.send.piece_send import NotDirect, PieceSender
    from slipstream.weights.wire.collective import Lanes
    from slipstream.weights.wire.stream import Manifest, plan_buckets

    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        sender = PieceSender(stream, tuple(plan_buckets(stream.metas(), 1 << 15)), rank, world)
    except NotDirect as e:
        return {"not_direct": str(e)}
    manifest = sender.manifest(1)
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    sink = CollectBuckets()
    groups = [dist.new_group([q], backend="nccl" if device.type == "cuda" else "gloo") for q in range(world)]
    own = groups[rank]._get_backend(device)  # the backend object itself, as the trainer's lanes are
    group = own if world == 1 else Lanes(tuple(own if q == rank else None for q in range(world)))
    sender.send(group, device, sink if rank == 0 else None, collect=True)
    dist.destroy_process_group(groups[rank])
    return {"buckets": [sink.buckets[i].cpu() for i in sorted(sink.buckets)], "senders": manifest.senders}


def _is_dtensor(entry) -> bool:
    from torch.distributed.tensor import DTensor

    module, attr, _, _ = entry
    return isinstance(getattr(module, attr), DTensor)


@pytest.fixture(scope="module")
def stream_runs(request, tiny_model_factory, tmp_path_factory):
    def make_job(case, folder):
        family, impl, world_size, parallel, _ = CASES[case]
        write_step_batches(folder / "out", 1, world_size=world_size)
        keep = KEEP_IN_FP32.get(case, ())
        args = (str(tiny_model_factory(family)), impl, parallel, keep, folder / "out", folder / "result.pt")
        return world_size, stream_both_ways, args

    return BatchedRanks(tmp_path_factory.mktemp("stream_gather"), selected_params(request, "case"), make_job)


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_gather_sends_the_same_bytes_as_unsharding(case, stream_runs):
    _check(case, torch.load(stream_runs.run(case) / "result.pt"), kept_in_fp32=case in KEEP_IN_FP32)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("case", ["qwen3-custom-fsdp2", "qwen3_moe-custom-fsdp2"])
def test_chunked_gather_over_nccl_sends_the_same_bytes_as_unsharding(case, tiny_model_factory, tmp_path):
    """The same on 2 GPUs: NCCL's asynchronous all-gathers, FSDP's bf16 mixed precision (its unsharded parameters are
    already bf16), CUDA streams."""
    from tests.distributed.helpers import run_ranks

    family, impl, world_size, parallel, _ = CASES[case]
    write_step_batches(tmp_path / "out", 1, world_size=world_size)
    model_dir = str(tiny_model_factory(family))
    # No tensor kept in float32 here: per-layer unsharding would publish FSDP's bf16 copy of it (the chunked gather
    # sends the float32 master), so the two paths would rightly differ.
    run_ranks(world_size, stream_both_ways, model_dir, impl, parallel, (), tmp_path / "out", tmp_path / "r.pt", "cuda")
    _check(case, torch.load(tmp_path / "r.pt"), kept_in_fp32=False)


def _check(case: str, results: dict, kept_in_fp32: bool) -> None:
    all_gathered = CASES[case][-1]
    reference = results["unshard"]
    assert reference["collectives"] is None and len(reference["buckets"]) >= 2
    for name in ("one_chunk", "chunk_per_layer"):
        got = results[name]
        assert len(got["buckets"]) == len(reference["buckets"])
        for i, (a, b) in enumerate(zip(got["buckets"], reference["buckets"], strict=True)):
            assert torch.equal(a, b), f"{name}: bucket {i} differs"
        assert got["all_gathered"] == all_gathered
    for name in ("pieces_root_unsharded", "pieces"):
        got = results[name]
        if case in NOT_DIRECT:
            assert "sharded as" in got["not_direct"]
            continue
        assert got["senders"] == CASES[case][2]
        assert len(got["buckets"]) == len(reference["buckets"])
        for i, (a, b) in enumerate(zip(got["buckets"], reference["buckets"], strict=True)):
            assert torch.equal(a, b), f"{name}: bucket {i} differs"
    one, per_layer = results["one_chunk"], results["chunk_per_layer"]
    assert one["whole"] > 0  # the root's tensors were taken whole
    assert one["chunks"] == 1 and per_layer["chunks"] == per_layer["groups"] > 1
    # One all-gather per process group and dtype in a chunk: the tiny models are one chunk, and the float32 q_norm
    # weights of qwen3-custom-fsdp2 add one. (ep2 on 2 ranks: the experts' ep group is the FSDP group.)
    assert one["collectives"] == (2 if kept_in_fp32 else 1)


@pytest.mark.parametrize(("rows", "size", "want"), [(10, 2, [5, 5]), (5, 4, [2, 2, 1, 0]), (1, 2, [1, 0])])
def test_rows_per_rank_follows_torch_chunk(rows, size, want):
    assert rows_per_rank(rows, size) == want
    chunks = [len(c) for c in torch.arange(rows).chunk(size)]
    assert want == chunks + [0] * (size - len(chunks))


def gather_uneven_rows(result_path) -> None:
    """Every rank: FSDP2 over 2 gloo ranks on tensors whose rows do not split evenly (5, 3 and 1 rows), gathered by
    ShardGatherer in float32 and bfloat16 over two chunks; rank 0 saves them next to `full_tensor()`."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from slipstream.weights.send.shard_gather import ShardGatherer

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(3, 1))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    plan = [
        [(layer, "weight", [f"{i}.weight"], None), (layer, "bias", [f"{i}.bias"], None)]
        for i, layer in enumerate(model)
    ]
    dtypes = [[torch.float32, torch.bfloat16]] * len(plan)
    gatherer = ShardGatherer(plan, dtypes, chunk_bytes=90)  # layer 0 (90 bytes) alone, then layers 1 and 2
    got = {}
    for chunk in range(len(gatherer.chunks)):
        got.update(gatherer.finish(gatherer.start(chunk)))
    want = {
        (k, i): getattr(m, a).full_tensor().to(dtypes[k][i])
        for k, g in enumerate(plan)
        for i, (m, a, _, _) in enumerate(g)
    }
    if dist.get_rank() == 0:
        torch.save(
            {"got": got, "want": want, "chunks": gatherer.chunks, "collectives": gatherer.num_collectives}, result_path
        )
    dist.barrier()
    dist.destroy_process_group()


def test_gather_splits_uneven_rows_as_fsdp_does(tmp_path):
    from tests.distributed.helpers import run_ranks

    run_ranks(2, gather_uneven_rows, tmp_path / "result.pt")
    result = torch.load(tmp_path / "result.pt")
    assert result["chunks"] == [[0], [1, 2]] and result["collectives"] == 4  # per chunk: float32 and bfloat16
    assert result["got"].keys() == result["want"].keys()
    for key, want in result["want"].items():
        assert result["got"][key].dtype == want.dtype and torch.equal(result["got"][key], want), key
