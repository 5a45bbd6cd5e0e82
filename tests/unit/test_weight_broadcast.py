"""Weight versions by broadcast (gloo, CPU): the trainer's publisher offers a version and sends it to the session the
orchestrator accepted; the receiver (a separate process running the receive code of Slipstream's vLLM engine) gets
exactly the tensors a filesystem publish writes. A receiver that dies mid-transfer leaves the trainer waiting for a
new session, to which it sends the version again whole."""

import threading

import pytest
import torch
from safetensors.torch import load_file

from slipstream.trainer.setup import setup_trainer, teardown_trainer
from slipstream.weights.send.folder import publish_weights
from slipstream.weights.send.publish import WeightPublisher
from slipstream.weights.wire.offers import (
    DELIVERED,
    Accept,
    is_offered,
    read_manifest,
    write_accept,
)
from slipstream.weights.wire.published import READY, read_probe, weights_dir
from tests.e2e.helpers import free_port
from tests.unit.weight_receiver_proc import gloo_trainer_config, start_receiver, wait_for


@pytest.mark.timeout(300)
def test_broadcast_survives_a_receiver_dying_mid_transfer(tiny_qwen3_dir, tmp_path):
    port = free_port()
    config = gloo_trainer_config(tiny_qwen3_dir, tmp_path / "run", port, max_steps=2, track_changes=True)
    trainer = setup_trainer(config)
    publisher = WeightPublisher(trainer, config)
    results: dict[int, dict] = {}
    try:
        for step, die_first in ((1, True), (2, False)):
            thread = threading.Thread(target=lambda s=step: results.update({s: publisher.publish(s)}))
            thread.start()
            wait_for(lambda s=step: is_offered(config.output_dir, s))
            assert len(read_manifest(config.output_dir, step)["buckets"]) >= 2  # a death can fall mid-transfer
            if die_first:
                write_accept(config.output_dir, step, Accept("first", 2))
                dead = start_receiver(config.output_dir, step, "first", 2, port, tmp_path / "dead.pt", die_after=1)
                assert dead.wait(timeout=60) == 3
                assert not (weights_dir(config.output_dir, step) / DELIVERED).exists()
            session = f"session-{step}"
            write_accept(config.output_dir, step, Accept(session, 2))
            out = tmp_path / f"got_{step}.pt"
            assert start_receiver(config.output_dir, step, session, 2, port, out).wait(timeout=60) == 0
            thread.join(timeout=60)
            assert not thread.is_alive()
            got = torch.load(out)["tensors"]
            reference = publish_weights(
                trainer.model,
                trainer.tokenizer,
                tmp_path / "ref",
                step,
                trainer.probe_token_ids,
                source_dir=tiny_qwen3_dir,
            )
            expected = load_file(reference / "model.safetensors")
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[k], expected[k]) for k in got)
            assert read_probe(config.output_dir, step) == read_probe(tmp_path / "ref", step)
    finally:
        publisher.close()
        teardown_trainer(trainer)
    assert results[1]["weights/send_attempts"] == 2 and results[2]["weights/send_attempts"] == 1
    for metrics in results.values():  # the sends alone: part of the whole send, which also writes offer and marker
        assert 0 < metrics["weights/wire_s"] <= metrics["weights/send_s"] and metrics["weights/wire_gbps"] > 0
    # weights.track_changes: step 1 (the first, sent twice) has nothing to compare with; step 2 is the same model
    # (no training between), compared with the bytes of step 1 that went out whole on the second attempt.
    assert "weights/changed_fraction" not in results[1]
    assert results[2]["weights/changed_fraction"] == 0.0 and results[2]["weights/delta_bytes"] == 0.0
    assert (weights_dir(config.output_dir, 1) / DELIVERED).exists()
    # Only the last step (resume and users need it) is also written to disk; step 1 lived in the broadcast only.
    assert not (weights_dir(config.output_dir, 1) / READY).exists()
    folder = weights_dir(config.output_dir, 2)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) == len(read_manifest(config.output_dir, 2)["buckets"]) and (folder / READY).exists()
    assert (folder / "model.safetensors.index.json").exists() and (folder / "config.json").exists()
