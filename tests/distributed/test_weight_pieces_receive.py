"""Two trainer ranks each broadcast their own rows of a bucket (weights/wire/pieces.py), each on its own lane, to two
receivers running the receive code of Slipstream's vLLM engine (weights/receive/receiver.py): each gets every
tensor whole, bit for bit, with uneven rows, a tensor held by one sender, a 0-d tensor and an empty one, over
several buckets of two dtypes (gloo). Two versions in a row: the second lands in the buffers and views kept from the
first."""

import math
import os

import torch

from slipstream.weights.wire.stream import Bucket, Manifest, TensorMeta

SHAPES = {"a": (5, 3), "b": (3,), "c": (), "d": (4, 2, 2), "e": (0, 7), "f": (6, 4)}
ROWS = {"a": (3, 2), "b": (0, 3), "c": (1, 0), "d": (2, 2), "e": (0, 0), "f": (3, 3)}


def _manifest() -> Manifest:
    def bucket(dtype, names):
        metas = tuple(TensorMeta(n, dtype, SHAPES[n]) for n in names)
        return Bucket(dtype, metas, tuple(ROWS[n] for n in names))

    return Manifest(4, (bucket("float32", "abc"), bucket("bfloat16", "de"), bucket("float32", "f")), senders=2)


def _tensors(version: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    manifest = _manifest()
    return {
        t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, b.dtype))
        for b in manifest.buckets
        for t in b.tensors
    }


def sender_or_receiver(port: int, out_path) -> None:
    from slipstream.weights.receive.receiver import WeightReceiver
    from slipstream.weights.wire.collective import GroupInit, open_group, open_store

    rank = int(os.environ["RANK"])
    init = GroupInit("gloo", "127.0.0.1", port, "s", world_size=4, rank_offset=2, timeout_s=60, senders=2)
    manifest = _manifest()
    if rank >= 2:  # two receivers: each lane is a sender and both
        receiver = WeightReceiver(torch.device("cpu"), rank_in_receivers=rank - 2)
        receiver.join(init)
        got = [{}, {}]
        for version in range(2):
            stats = receiver.receive(
                {"step": 4, "manifest": manifest.to_dict()},
                lambda pairs, v=version: got[v].update({n: t.clone() for n, t in pairs}),
            )
        torch.save({"got": got, "bytes": stats.num_bytes}, f"{out_path}.{rank}")
        for lane in receiver.group.held():  # no sender leaves before the receiver has everything
            lane.barrier().wait()
        receiver.shutdown()
        return
    store = open_store("127.0.0.1", port, is_master=rank == 0, timeout_s=60)
    lanes = open_group(store, init, rank, torch.device("cpu"))
    assert [g is not None for g in lanes.groups] == [rank == 0, rank == 1]  # a sender is in its own lane only
    for version in range(2):
        send_rows(lanes, rank, manifest, _tensors(version))
    lanes.groups[rank].barrier().wait()


def send_rows(lanes, rank: int, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
    """Sender `rank`'s part of one version: its rows of every tensor, broadcast bucket by bucket."""
    from slipstream.weights.wire.stream import start_pieces

    for bucket in manifest.buckets:
        wire = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for meta, (offset, nbytes), split in zip(
            bucket.tensors, bucket.layout.own[rank], bucket.rows, strict=True
        ):  # this sender's rows only: the other's stay zero here
            t = tensors[meta.name]
            rows = t.reshape(t.shape[0] if t.dim() else 1, math.prod(t.shape[1:]))
            mine = rows[sum(split[:rank]) : sum(split[: rank + 1])].reshape(-1)
            wire[offset : offset + nbytes] = mine.view(torch.uint8)
        for work in start_pieces(lanes, wire, bucket.layout):
            work.wait()


def test_two_receivers_get_every_tensor_whole_from_two_senders(tmp_path):
    from tests.distributed.helpers import run_ranks
    from tests.e2e.helpers import free_port

    run_ranks(4, sender_or_receiver, free_port(), tmp_path / "got.pt")
    for rank in (2, 3):
        result = torch.load(tmp_path / f"got.pt.{rank}")
        for version, got in enumerate(result["got"]):
            want = _tensors(version)
            assert got.keys() == want.keys()
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (rank, version, name)
        assert result["bytes"] == _manifest().nbytes
