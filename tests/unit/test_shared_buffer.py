"""The ipc weight transport's buffer (weights/wire/shared_buffer.py), CPU twin: the trainer lays buckets of several
dtypes out in a shared-memory file, another process maps it from the handle alone, and the receiver hands the model's
loader tensors equal to the trainer's, byte for byte."""

import json
import subprocess
import sys

import pytest
import torch

from slipstream.weights.receive.receiver import WeightReceiver
from slipstream.weights.wire.shared_buffer import ALIGN, SharedBuffer, SharedSink, bucket_offsets, open_shared
from slipstream.weights.wire.stream import Manifest, TensorMeta, plan_buckets


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(33, 7).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 7).to(torch.bfloat16),
        "model.norm.weight": torch.randn(7),  # float32: a bucket of its own, after a bf16 one of odd size
        "lm_head.weight": torch.randn(33, 7).to(torch.bfloat16),
    }


def _laid_out(tensors) -> tuple[Manifest, SharedBuffer]:
    metas = [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    manifest = Manifest(3, tuple(plan_buckets(metas, 400)))
    sizes = [b.nbytes for b in manifest.buckets]
    buffer = SharedBuffer(bucket_offsets(sizes)[1], torch.device("cpu"), name="test")
    sink = SharedSink(buffer, sizes)
    for i, bucket in enumerate(manifest.buckets):
        flat = torch.cat([tensors[t.name].reshape(-1).view(torch.uint8) for t in bucket.tensors])
        sink.send(i, bucket, flat)
    sink.close()
    return manifest, buffer


def test_offsets_are_aligned_and_in_order():
    offsets, total = bucket_offsets([10, 300, 1])
    assert offsets == [0, ALIGN, 3 * ALIGN] and total == 3 * ALIGN + 1  # 300 bytes from 256 end at 556


def test_the_receiver_loads_every_tensor_exactly_from_the_mapped_buffer():
    tensors = _tensors()
    manifest, buffer = _laid_out(tensors)
    assert len(manifest.buckets) >= 3
    got: dict[str, torch.Tensor] = {}
    receiver = WeightReceiver(torch.device("cpu"))
    stats = receiver.receive(
        {"step": 3, "manifest": manifest.to_dict(), "shared": buffer.handle()},
        lambda pairs: got.update((n, t.clone()) for n, t in pairs),
    )
    assert stats.source == "shared memory" and stats.names == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype, name
    buffer.close()


def test_another_process_maps_the_buffer_from_its_handle():
    tensors = _tensors()
    manifest, buffer = _laid_out(tensors)
    handle = json.dumps(buffer.handle())  # what travels in update_info
    code = (
        "import json, sys, torch\n"
        "from slipstream.weights.wire.shared_buffer import open_shared\n"
        "flat = open_shared(json.loads(sys.argv[1]), torch.device('cpu'))\n"
        "print(int(flat.to(torch.int64).sum()), flat.numel())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, handle], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(int(buffer.tensor.to(torch.int64).sum())), str(buffer.nbytes)]
    buffer.close()
    with pytest.raises(ValueError, match="missing or shorter"):
        open_shared(json.loads(handle), torch.device("cpu"))  # the trainer dropped it: a clear error, no crash


@pytest.mark.parametrize(
    ("handle", "match"),
    [
        ({"kind": "file", "path": "/nonexistent", "nbytes": 4}, "missing or shorter"),
        ({"kind": "smoke", "nbytes": 4}, "kind 'smoke'"),
        ({"kind": "file", "path": "/x", "nbytes": -1}, "'nbytes' must be an integer"),
        ({"kind": "cuda", "nbytes": 4}, "runs on CPU"),
    ],
)
def test_bad_handles_are_refused_with_the_reason(handle, match):
    with pytest.raises(ValueError, match=match):
        open_shared(handle, torch.device("cpu"))
