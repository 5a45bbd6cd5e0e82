"""Filesystem transport: batches and weights appear whole or not at all; malformed files give clear errors."""

import os

import msgspec
import pytest

from slipstream.transport.rollouts import (
    BatchFormatError,
    MicroBatch,
    TrainingBatch,
    batch_path,
    read_batch,
    wait_for_batch,
    write_batch,
)
from slipstream.utils.fs import commit_dir
from slipstream.weights.wire.offers import wait_for_available
from slipstream.weights.wire.published import is_ready, latest_ready_step, weights_dir


def _batch(step=1, rank=0):
    mb = MicroBatch(
        input_ids=[1, 2, 3],
        position_ids=[0, 1, 2],
        loss_mask=[False, True, True],
        advantages=[0.0, 0.5, 0.5],
        inference_logprobs=[0.0, -1.0, -2.0],
        temperatures=[1.0, 1.0, 1.0],
    )
    return TrainingBatch(step=step, rank=rank, num_loss_tokens=2, micro_batches=[mb], metrics={"reward/mean": 0.5})


def test_batch_round_trip(tmp_path):
    path = write_batch(tmp_path, _batch())
    assert path == batch_path(tmp_path, 1, 0)
    assert read_batch(path) == _batch()
    assert wait_for_batch(tmp_path, 1, 0, timeout_s=1) == _batch()


def test_crash_during_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise OSError("disk died")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk died"):
        write_batch(tmp_path, _batch())
    folder = batch_path(tmp_path, 1, 0).parent
    assert list(folder.iterdir()) == []  # neither the batch nor a temp file


def test_rewrite_is_all_or_nothing(tmp_path, monkeypatch):
    write_batch(tmp_path, _batch())
    monkeypatch.setattr(os, "replace", lambda *a, **k: (_ for _ in ()).throw(OSError("no")))
    with pytest.raises(OSError):
        write_batch(tmp_path, msgspec.structs.replace(_batch(), num_loss_tokens=9))
    assert read_batch(batch_path(tmp_path, 1, 0)).num_loss_tokens == 2  # old content intact


def test_malformed_batches_are_rejected(tmp_path):
    path = tmp_path / "bad.msgpack"
    path.write_bytes(b"\x00garbage")
    with pytest.raises(BatchFormatError, match="not a valid training batch"):
        read_batch(path)
    bad = msgspec.structs.replace(
        _batch(), micro_batches=[msgspec.structs.replace(_batch().micro_batches[0], loss_mask=[True])]
    )
    path.write_bytes(msgspec.msgpack.encode(bad))
    with pytest.raises(BatchFormatError, match="different lengths"):
        read_batch(path)
    path.write_bytes(msgspec.msgpack.encode(msgspec.structs.replace(_batch(), format_version=99)))
    with pytest.raises(BatchFormatError, match="format 99"):
        read_batch(path)


def test_wait_for_batch_times_out_with_message(tmp_path):
    with pytest.raises(TimeoutError, match="orchestrator's batch"):
        wait_for_batch(tmp_path, 3, 0, timeout_s=0.1)


def test_weights_ready_only_after_commit(tmp_path):
    tmp = tmp_path / "weights" / ".tmp_step_1"
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"x")
    assert latest_ready_step(tmp_path) is None
    (tmp / "READY").write_text("")
    commit_dir(tmp, weights_dir(tmp_path, 1))
    assert is_ready(tmp_path, 1) and latest_ready_step(tmp_path) == 1
    assert wait_for_available(tmp_path, 1, timeout_s=1) == 1
    with pytest.raises(TimeoutError, match="publish"):
        wait_for_available(tmp_path, 2, timeout_s=0.1)
