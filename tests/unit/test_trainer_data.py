"""Packed <-> padded layout helpers and micro-batch validation of trainer/data.py."""

import pytest
import torch

from slipstream.trainer.data import (
    MicroBatchError,
    build_padded_layout,
    pack,
    to_packed,
    unpack,
    validate_batch,
)
from slipstream.transport.rollouts import MicroBatch, TrainingBatch


def _mb(position_ids, loss_mask=None, temperatures=None):
    n = len(position_ids)
    return MicroBatch(
        input_ids=list(range(10, 10 + n)),
        position_ids=position_ids,
        loss_mask=loss_mask or [False] * n,
        advantages=[0.0] * n,
        inference_logprobs=[0.0] * n,
        temperatures=temperatures or [1.0] * n,
    )


def test_layout_unpack_pack_round_trip():
    position_ids_T = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])
    layout = build_padded_layout(position_ids_T)
    assert (layout.num_rows, layout.max_len) == (3, 4)
    assert layout.row_T.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert layout.is_start_T.tolist() == [True, False, False, True, False, True, False, False, False]
    values_T = torch.arange(9) + 1
    values_BL = unpack(values_T, layout, pad_value=-1)
    assert values_BL.tolist() == [[1, 2, 3, -1], [4, 5, -1, -1], [6, 7, 8, 9]]
    assert torch.equal(pack(values_BL, layout), values_T)
    hidden_TD = torch.randn(9, 2)
    assert torch.equal(pack(unpack(hidden_TD, layout, 0.0), layout), hidden_TD)


@pytest.mark.parametrize("position_ids", [[1, 2, 3], [0, 1, 3], [0, 2, 0]])
def test_layout_rejects_bad_positions(position_ids):
    with pytest.raises(MicroBatchError, match="position_ids"):
        build_padded_layout(torch.tensor(position_ids))


def test_to_packed_validates_contract():
    packed = to_packed(_mb([0, 1, 2], loss_mask=[False, True, True]), torch.device("cpu"))
    assert packed.num_tokens == 3 and packed.loss_mask_T.tolist() == [False, True, True]
    with pytest.raises(MicroBatchError, match="first token"):
        to_packed(_mb([0, 1, 0], loss_mask=[False, False, True]), torch.device("cpu"))
    with pytest.raises(MicroBatchError, match="temperatures"):
        to_packed(_mb([0, 1], temperatures=[1.0, 0.0]), torch.device("cpu"))
    with pytest.raises(MicroBatchError, match="empty"):
        to_packed(_mb([]), torch.device("cpu"))


def test_validate_batch_checks_loss_token_count():
    mb = _mb([0, 1, 2], loss_mask=[False, True, True])
    validate_batch(TrainingBatch(step=1, rank=0, num_loss_tokens=2, micro_batches=[mb]), 1, 0, world_size=1)
    with pytest.raises(MicroBatchError, match="must be equal"):
        validate_batch(TrainingBatch(step=1, rank=0, num_loss_tokens=3, micro_batches=[mb]), 1, 0, world_size=1)
    with pytest.raises(MicroBatchError, match="across all ranks"):
        validate_batch(TrainingBatch(step=1, rank=0, num_loss_tokens=1, micro_batches=[mb]), 1, 0, world_size=2)
    with pytest.raises(MicroBatchError, match="step 2"):
        validate_batch(TrainingBatch(step=1, rank=0, num_loss_tokens=2, micro_batches=[mb]), 2, 0, world_size=1)


def test_micro_batches_convert_on_one_cpu_thread_and_restore_the_setting(monkeypatch):
    """to_packed runs its CPU ops on one thread (a pool per tiny op is slower) and gives the thread count back, also
    when the micro-batch is refused."""
    from slipstream.trainer import data

    seen = []
    validate = data.validate_packed
    monkeypatch.setattr(
        data, "validate_packed", lambda packed: seen.append(torch.get_num_threads()) or validate(packed)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        to_packed(_mb([0, 1, 2], loss_mask=[False, True, True]), torch.device("cpu"))
        with pytest.raises(MicroBatchError):
            to_packed(_mb([0, 1], temperatures=[1.0, 0.0]), torch.device("cpu"))
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
