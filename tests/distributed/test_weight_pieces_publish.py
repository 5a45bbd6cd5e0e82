"""Two trainer ranks (FSDP=2, gloo) publish by broadcast, each sending its own rows (weights/send/piece_send.py), to a
receiver process running the receive code of Slipstream's vLLM engine: it gets exactly the tensors the gather path
lays out. A receiver that dies mid-transfer makes both ranks fail the attempt together; they wait for a new session
and send the version again whole, and the last step is also written to disk."""

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slipstream.weights.wire.offers import DELIVERED, Accept, is_offered, read_manifest, write_accept
from slipstream.weights.wire.published import READY, weights_dir
from tests.e2e.helpers import free_port
from tests.unit.weight_receiver_proc import start_receiver, wait_for


def publish_two_steps(model_dir: str, out: Path, port: int, result: Path) -> None:
    """Every rank: set up the trainer and publish steps 1 and 2 by gloo broadcast; after each, rank 0 saves the
    tensors the gather path lays out (the reference) and the publish metrics."""
    import torch.distributed as dist

    from slipstream.config.shared import ModelConfig
    from slipstream.config.trainer import TrainerConfig
    from slipstream.config.weights import WeightsConfig
    from slipstream.trainer.setup import setup_trainer, teardown_trainer
    from slipstream.weights.send.publish import WeightPublisher
    from slipstream.weights.wire.bucket_assembly import stream_to
    from slipstream.weights.wire.stream import Manifest, unpack

    class Collect:
        def __init__(self) -> None:
            self.tensors: dict[str, torch.Tensor] = {}

        def send(self, index, bucket, flat) -> None:
            self.tensors.update({n: t.clone() for n, t in unpack(flat, bucket)})

        def close(self) -> None:
            pass

    weights = WeightsConfig(transport="gloo", master_port=port, bucket_mb=1, accept_timeout_s=120)
    config = TrainerConfig(
        model=ModelConfig(name=model_dir), output_dir=out, max_steps=2, device="cpu", num_threads=1, weights=weights
    )
    trainer = setup_trainer(config)
    publisher = WeightPublisher(trainer, config)
    saved = {"senders": None if publisher.pieces is None else publisher.pieces.world}
    try:
        for step in (1, 2):
            saved[step] = publisher.publish(step)
            sink = Collect()
            stream_to(publisher.stream, Manifest(step, publisher.buckets), [sink] if dist.get_rank() == 0 else [])
            saved[f"reference_{step}"] = sink.tensors
    finally:
        publisher.close()
        if dist.get_rank() == 0:
            torch.save(saved, result)
        teardown_trainer(trainer)


@pytest.mark.timeout(400)
def test_two_ranks_send_their_rows_and_survive_a_receiver_dying(tiny_qwen3_dir, tmp_path):
    from tests.distributed.helpers import run_ranks

    out, port, result = tmp_path / "run", free_port(), tmp_path / "result.pt"
    failure: list[BaseException] = []

    def ranks() -> None:
        try:
            run_ranks(2, publish_two_steps, str(tiny_qwen3_dir), out, port, result)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            failure.append(e)

    thread = threading.Thread(target=ranks)
    thread.start()
    received = {}
    for step, die_first in ((1, True), (2, False)):
        wait_for(lambda s=step: is_offered(out, s) or failure, timeout_s=120)
        assert not failure, failure
        manifest = read_manifest(out, step)
        assert manifest["senders"] == 2 and len(manifest["buckets"]) >= 2  # a death can fall mid-transfer
        offer = json.loads((weights_dir(out, step) / "OFFER").read_text())
        assert offer["senders"] == 2
        if die_first:
            write_accept(out, step, Accept("first", 3))
            dead = start_receiver(out, step, "first", 3, port, tmp_path / "dead.pt", die_after=1, senders=2)
            assert dead.wait(timeout=120) == 3
            assert not (weights_dir(out, step) / DELIVERED).exists()
        session = f"session-{step}"
        write_accept(out, step, Accept(session, 3))
        got = tmp_path / f"got_{step}.pt"
        assert start_receiver(out, step, session, 3, port, got, senders=2).wait(timeout=120) == 0
        received[step] = torch.load(got)["tensors"]
    thread.join(timeout=180)
    assert not thread.is_alive() and not failure, failure
    saved = torch.load(result)
    assert saved["senders"] == 2
    for step in (1, 2):
        reference = saved[f"reference_{step}"]
        assert received[step].keys() == reference.keys()
        assert all(torch.equal(received[step][k], reference[k]) for k in reference), step
    assert saved[1]["weights/send_attempts"] == 2 and saved[2]["weights/send_attempts"] == 1
    assert (weights_dir(out, 1) / DELIVERED).exists() and not (weights_dir(out, 1) / READY).exists()
    # the last step is also on disk, laid out whole by rank 0 from every rank's pieces
    folder = weights_dir(out, 2)
    assert (folder / READY).exists()
    on_disk = {}
    for shard in sorted(folder.glob("model*.safetensors")):
        on_disk.update(load_file(shard))
    assert on_disk.keys() == received[2].keys()
    assert all(torch.equal(on_disk[k], received[2][k]) for k in on_disk)
