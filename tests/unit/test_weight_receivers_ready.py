"""The senders of a version wait until every receiver is about to post its receives (weights/wire/collective.py:
`mark_posted`), and count that wait apart from the transfer: a receiver that comes late (vLLM's workers reach
/update_weights after the API server's loop, 100-300 ms late on GPUs) shows in `weights/receiver_wait_s`, not in
`weights/wire_s`, and what arrives is unchanged. The receiver's own stats split its time at the mark: a slow loader
shows in `host_s`. Gloo on CPU, the receiver in a thread."""

import threading
import time

import pytest
import torch

from slipstream.trainer.setup import setup_trainer, teardown_trainer
from slipstream.weights.receive.receiver import WeightReceiver
from slipstream.weights.send.publish import WeightPublisher
from slipstream.weights.wire.collective import GroupInit
from slipstream.weights.wire.offers import Accept, is_offered, read_manifest, write_accept
from tests.e2e.helpers import free_port
from tests.unit.weight_receiver_proc import gloo_trainer_config, wait_for

LATE_S = 1.0
LOAD_S = 0.5
"""The second version's loader sleeps this long per bucket: far above what the first version's fast loader takes in
all (0.22 s for 2 MB beside the rest of `make test` on 2 cores, where 0.05 s a bucket made the comparison flaky)."""


@pytest.mark.timeout(300)
def test_a_late_receiver_is_waited_for_outside_the_transfer_time(tiny_qwen3_dir, tmp_path):
    port = free_port()
    config = gloo_trainer_config(tiny_qwen3_dir, tmp_path / "run", port, max_steps=2)
    trainer = setup_trainer(config)
    publisher = WeightPublisher(trainer, config)
    receiver = WeightReceiver(torch.device("cpu"))
    results: dict[int, dict] = {}
    got: dict[int, dict[str, torch.Tensor]] = {1: {}, 2: {}}
    stats, loads = {}, []

    def load(step: int, pairs) -> None:
        got[step].update({n: t.clone() for n, t in pairs})
        if step == 2:
            loads.append(len(pairs))
            time.sleep(LOAD_S)

    try:
        for step, late_s in ((1, LATE_S), (2, 0.0)):
            thread = threading.Thread(target=lambda s=step: results.update({s: publisher.publish(s)}))
            thread.start()
            wait_for(lambda s=step: is_offered(config.output_dir, s))
            write_accept(config.output_dir, step, Accept("session-1", 2))
            if step == 1:
                receiver.join(GroupInit("gloo", "127.0.0.1", port, "session-1", 2, timeout_s=60))
            time.sleep(late_s)  # the sender has joined and waits; without the marks it would be sending already
            info = {"step": step, "manifest": read_manifest(config.output_dir, step)}
            stats[step] = receiver.receive(info, lambda pairs, s=step: load(s, pairs))
            thread.join(timeout=60)
            assert not thread.is_alive()
    finally:
        receiver.shutdown()
        publisher.close()
        teardown_trainer(trainer)
    first, second = results[1], results[2]
    assert first["weights/receiver_wait_s"] >= 0.9 * LATE_S, first
    assert first["weights/wire_s"] < 0.5 * LATE_S and first["weights/send_s"] < 0.5 * LATE_S, first
    assert second["weights/receiver_wait_s"] < 0.5 * LATE_S, second
    assert len(got[1]) > 5 and got[1].keys() == got[2].keys()
    assert all(torch.equal(got[1][k], got[2][k]) for k in got[1])  # no training in between: the same version
    slow = stats[2].to_dict()
    assert len(loads) > 1 and slow["host_s"] >= slow["load_s"] >= LOAD_S * len(loads), slow
    assert slow["marked_s"] + slow["host_s"] <= slow["seconds"] + 1e-3, slow
    assert stats[1].host_s < LOAD_S * len(loads), stats[1]
