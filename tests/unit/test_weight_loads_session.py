"""The orchestrator's transfer session follows the trainer's offer: as many trainer ranks as the offer says send
(group ranks 0 .. senders - 1), the inference workers follow; a session is reused while the instance and the
senders are the same. A malformed `senders` in an offer is refused with the field named."""

import asyncio
import json

import pytest

from slipstream.config.weights import WeightsConfig
from slipstream.orchestrator.weight_loads import WeightLoader
from slipstream.weights.wire.collective import GroupInit
from slipstream.weights.wire.offers import OFFER, read_offer
from slipstream.weights.wire.published import weights_dir


class _Client:
    instance = "inference-1"

    async def get_world_size(self) -> int:
        return 3


def _offer(out, step: int, **fields) -> None:
    folder = weights_dir(out, step)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / OFFER).write_text(json.dumps({"step": step, "backend": "gloo", **fields}))


def test_session_has_the_offers_senders_then_the_workers(tmp_path):
    loader = WeightLoader(_Client(), tmp_path, WeightsConfig(transport="gloo", master_port=29500))
    _offer(tmp_path, 1, senders=2)
    init = asyncio.run(loader._maybe_new_session(read_offer(tmp_path, 1)))
    assert init["world_size"] == 5 and init["rank_offset"] == 2 and init["backend"] == "gloo"
    _offer(tmp_path, 2, senders=2)
    assert (
        asyncio.run(loader._maybe_new_session(read_offer(tmp_path, 2))) is None
    )  # same instance, same senders: the group stays
    _offer(tmp_path, 3)  # an older trainer's offer: rank 0 alone sends
    init = asyncio.run(loader._maybe_new_session(read_offer(tmp_path, 3)))
    assert init["world_size"] == 4 and init["rank_offset"] == 1


def test_session_carries_the_workers_receive_buffers(tmp_path):
    weights = WeightsConfig(transport="gloo", master_port=29500, receive_buffers=5)
    _offer(tmp_path, 1)
    init = asyncio.run(WeightLoader(_Client(), tmp_path, weights)._maybe_new_session(read_offer(tmp_path, 1)))
    assert init["receive_buffers"] == 5
    assert GroupInit(**init).receive_buffers == 5  # what each worker joins with (WeightReceiver.join)


@pytest.mark.parametrize("senders", [0, -1, "2", True, 1.5])
def test_an_offer_with_bad_senders_is_refused(tmp_path, senders):
    _offer(tmp_path, 1, senders=senders)
    with pytest.raises(ValueError, match="field 'senders' must be an integer >= 1"):
        read_offer(tmp_path, 1)
    _offer(tmp_path, 2)
    assert read_offer(tmp_path, 2)["senders"] == 1
