"""`weights.delta` through the trainer's publisher (gloo, CPU): versions offered, accepted and sent as deltas to a
WeightReceiver that lives across versions (the receive code of Slipstream's vLLM engine, in a thread); what it loads
is exactly what a filesystem publish of the same step writes, also when a delta is corrupted on the way."""

import threading

import pytest
import torch
from safetensors.torch import load_file

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.config.weights import DeltaConfig, WeightsConfig
from slipstream.trainer.setup import setup_trainer, teardown_trainer
from slipstream.weights.receive.receiver import WeightReceiver
from slipstream.weights.send import delta_send
from slipstream.weights.send.folder import publish_weights
from slipstream.weights.send.publish import WeightPublisher
from slipstream.weights.wire.collective import GroupInit
from slipstream.weights.wire.delta import SPARSE, Encoded
from slipstream.weights.wire.offers import Accept, is_offered, read_manifest, write_accept
from tests.e2e.helpers import free_port
from tests.unit.weight_receiver_proc import wait_for


def _train_a_little(model: torch.nn.Module, step: int) -> None:
    """What an optimizer step in a low precision does to the published bytes: a few elements change."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.data.view(-1)
            picked = torch.rand(flat.numel(), generator=g) < 0.01
            flat[picked] += 0.25


def _corrupt_once(monkeypatch) -> dict:
    """From now on, the first sparse bucket's payload is damaged (after its checksum was taken), once."""
    encode = delta_send.encode
    state = {"done": False}

    def damaged(new, old, size, full=False) -> Encoded:
        encoded = encode(new, old, size, full=full)
        if not state["done"] and encoded.header.mode == SPARSE and encoded.header.count:
            state["done"] = True
            payload = encoded.payload.clone()
            payload[-1] ^= 0x01
            return Encoded(encoded.header, payload, encoded.changed)
        return encoded

    monkeypatch.setattr(delta_send, "encode", damaged)
    return state


@pytest.mark.timeout(300)
def test_delta_versions_load_exactly_what_a_full_publish_writes(tiny_qwen3_dir, tmp_path, monkeypatch):
    port = free_port()
    config = TrainerConfig(
        model=ModelConfig(name=str(tiny_qwen3_dir)),
        output_dir=tmp_path / "run",
        max_steps=4,
        device="cpu",
        weights=WeightsConfig(
            transport="gloo", master_port=port, bucket_mb=1, accept_timeout_s=120, delta=DeltaConfig(enabled=True)
        ),
    )
    trainer = setup_trainer(config)
    publisher = WeightPublisher(trainer, config)
    receiver = WeightReceiver(torch.device("cpu"))
    results: dict[int, dict] = {}
    stats: dict[int, dict] = {}
    corruption = None
    try:
        assert publisher.pieces is None and publisher.delta is not None  # rank 0 sends what it gathered
        for step in (1, 2, 3, 4):
            if step > 1:
                _train_a_little(trainer.model, step)
            if step == 3:
                corruption = _corrupt_once(monkeypatch)
            thread = threading.Thread(target=lambda s=step: results.update({s: publisher.publish(s)}))
            thread.start()
            wait_for(lambda s=step: is_offered(config.output_dir, s))
            manifest = read_manifest(config.output_dir, step)
            assert manifest["delta"] is True and len(manifest["buckets"]) >= 2
            session = "session-1" if step < 4 else "session-2"  # inference restarts before step 4
            write_accept(config.output_dir, step, Accept(session, 2))  # the trainer joins the session's group now
            if step in (1, 4):
                receiver.join(GroupInit("gloo", "127.0.0.1", port, session, 2, timeout_s=60))
            got: dict[str, torch.Tensor] = {}
            info = {"step": step, "manifest": manifest}
            received = receiver.receive(info, lambda pairs, got=got: got.update({n: t.clone() for n, t in pairs}))
            stats[step] = received.to_dict()["delta"]
            thread.join(timeout=60)
            assert not thread.is_alive()
            reference = publish_weights(
                trainer.model, trainer.tokenizer, tmp_path / "ref", step, trainer.probe_token_ids,
                source_dir=tiny_qwen3_dir,
            )  # fmt: skip
            expected = load_file(reference / "model.safetensors")
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in got), step
    finally:
        receiver.shutdown()
        publisher.close()
        teardown_trainer(trainer)
    assert corruption is not None and corruption["done"]
    full = results[1]["weights/full_bytes"]
    assert full == results[1]["weights/bytes"]
    # step 1: the first version goes whole; step 4: a new session, whole again
    for step in (1, 4):
        assert results[step]["weights/delta_full_version"] == 1.0 and stats[step]["sparse"] == 0
        assert results[step]["weights/delta_bytes_sent"] >= full
    # steps 2-3: about 1% of the elements changed, sent as deltas (int32 index + float32 value each)
    for step in (2, 3):
        m = results[step]
        assert 0.005 < m["weights/changed_fraction"] < 0.02
        assert m["weights/delta_sparse_buckets"] > 0
        assert m["weights/delta_bytes_sent"] == stats[step]["wire_bytes"]
    assert results[2]["weights/delta_bytes_sent"] < 0.05 * full and results[2]["weights/delta_resent_buckets"] == 0
    assert results[3]["weights/delta_resent_buckets"] == 1 and stats[3]["repaired"] == 1


def test_delta_config_refuses_what_it_cannot_serve():
    from pydantic import ValidationError

    assert not WeightsConfig().delta.enabled and WeightsConfig().delta.full_every == 10
    for transport in ("auto", "filesystem", "ipc"):
        with pytest.raises(ValidationError, match='set weights.transport = "nccl" \\(GPUs\\) or "gloo"'):
            WeightsConfig(transport=transport, delta=DeltaConfig(enabled=True))
    for transport in ("nccl", "gloo"):
        assert WeightsConfig(transport=transport, delta=DeltaConfig(enabled=True)).delta.enabled
    with pytest.raises(ValidationError, match="set weights.track_changes = false"):
        WeightsConfig(transport="gloo", track_changes=True, delta=DeltaConfig(enabled=True))
    with pytest.raises(ValidationError):
        DeltaConfig(full_every=0)
