"""weights.track_changes: what each version changed since the one before, as a delta update would send it."""

import pytest
import torch
from safetensors.torch import load_file

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.config.weights import WeightsConfig
from slipstream.trainer.setup import setup_trainer, teardown_trainer
from slipstream.weights.send.changes import ChangeTracker
from slipstream.weights.send.publish import WeightPublisher
from slipstream.weights.wire.published import weights_dir
from slipstream.weights.wire.stream import Bucket, TensorMeta


def _plan(tensors: dict[str, torch.Tensor]) -> tuple[Bucket, ...]:
    by_dtype: dict[torch.dtype, list] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(TensorMeta.of(name, t))
    return tuple(Bucket(metas[0].dtype, tuple(metas)) for metas in by_dtype.values())


def _flat(tensors: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
    return torch.cat([tensors[m.name].reshape(-1).view(torch.uint8) for m in bucket.tensors])


def _send(tracker: ChangeTracker, step: int, tensors: dict, plan, only: int | None = None) -> None:
    tracker.begin(step, plan)
    for i, bucket in enumerate(plan):
        if only is None or i == only:
            tracker.send(i, bucket, _flat(tensors, bucket))


def test_changes_are_counted_bitwise_per_element_and_priced_as_a_sparse_send():
    g = torch.Generator().manual_seed(0)
    v = {
        "a": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b": torch.randn(100, generator=g).to(torch.bfloat16),
        "c": torch.randn(50, generator=g),  # float32: its own bucket
    }
    v["c"][7] = -0.0
    plan = _plan(v)
    tracker = ChangeTracker()
    _send(tracker, 1, v, plan)
    assert tracker.take() == {}  # nothing to compare the first version with

    w = {k: t.clone() for k, t in v.items()}
    w["a"][3, :10] += 1.0  # 10 elements change
    w["b"][0] = -w["b"][0]  # one more; a bf16 value that rounds back to itself changes nothing:
    w["b"][1] = (w["b"][1].float() + 1e-6).to(torch.bfloat16)
    w["c"][7] = 0.0  # -0.0 -> 0.0: the same number, other bits, so a change on the wire
    _send(tracker, 2, w, plan)
    m = tracker.take()
    elements = 64 * 32 + 100 + 50
    assert m["weights/changed_fraction"] == pytest.approx(12 / elements)
    assert m["weights/delta_bytes"] == 11 * (4 + 2) + 1 * (4 + 4)
    full = sum(b.nbytes for b in plan)
    assert m["weights/delta_ratio"] == pytest.approx(m["weights/delta_bytes"] / full)
    assert tracker.take() == {}  # taken once

    # Everything changes: a bucket is never priced above its full size.
    x = {k: t + 1 for k, t in w.items()}
    _send(tracker, 3, x, plan)
    m = tracker.take()
    assert m["weights/changed_fraction"] == 1.0 and m["weights/delta_bytes"] == full


def _after_version_1(v: dict) -> tuple[ChangeTracker, tuple[Bucket, ...]]:
    """A tracker that has compared nothing yet but holds version 1 = `v`, and `v`'s plan."""
    plan = _plan(v)
    tracker = ChangeTracker()
    _send(tracker, 1, v, plan)
    assert tracker.take() == {}
    return tracker, plan


def test_a_version_sent_again_after_a_failed_attempt_is_compared_once():
    tracker, plan = _after_version_1({"a": torch.zeros(40, dtype=torch.bfloat16), "b": torch.zeros(8)})
    w = {"a": torch.ones(40, dtype=torch.bfloat16), "b": torch.zeros(8)}
    _send(tracker, 2, w, plan, only=0)  # the attempt died after bucket 0
    _send(tracker, 2, w, plan)  # the version again, whole
    m = tracker.take()
    assert m["weights/changed_fraction"] == pytest.approx(40 / 48)  # bucket 0's 40 changes, counted once


def test_a_version_never_sent_whole_is_not_what_the_next_one_is_compared_with():
    tracker, plan = _after_version_1({"a": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(4)})
    _send(tracker, 2, {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.ones(4)}, plan, only=0)
    assert tracker.take() == {}  # bucket 1 never went out
    _send(tracker, 3, {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.ones(4)}, plan)
    assert tracker.take() == {}  # half of "the version before" was step 1's, half step 2's: start over
    _send(tracker, 4, {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.ones(4)}, plan)
    assert tracker.take()["weights/changed_fraction"] == 0.0


def test_the_publisher_reports_the_changes_between_published_folders(tiny_qwen3_dir, tmp_path):
    config = TrainerConfig(
        model=ModelConfig(name=str(tiny_qwen3_dir)),
        output_dir=tmp_path / "run",
        max_steps=2,
        device="cpu",
        weights=WeightsConfig(transport="filesystem", bucket_mb=1, track_changes=True),
    )
    trainer = setup_trainer(config)
    publisher = WeightPublisher(trainer, config)
    try:
        assert "weights/changed_fraction" not in publisher.publish(1)
        with torch.no_grad():
            weight = trainer.model.get_parameter("layers.0.mlp.down_proj.weight")
            weight[:2] += 0.5
        m = publisher.publish(2)
    finally:
        publisher.close()
        teardown_trainer(trainer)
    before, after = ({}, {})
    for step, out in ((1, before), (2, after)):
        for shard in weights_dir(config.output_dir, step).glob("*.safetensors"):
            out.update(load_file(shard))
    changed = sum(
        int(
            (
                before[k].view(torch.int16 if before[k].element_size() == 2 else torch.int32)
                != after[k].view(torch.int16 if after[k].element_size() == 2 else torch.int32)
            ).sum()
        )
        for k in before
    )
    elements = sum(t.numel() for t in before.values())
    assert changed > 0
    assert m["weights/changed_fraction"] == pytest.approx(changed / elements)
    assert m["weights/bytes"] == sum(t.numel() * t.element_size() for t in before.values())


def test_track_changes_is_refused_with_lora_adapters(tiny_qwen3_dir, tmp_path):
    config = TrainerConfig.model_validate(
        {
            "model": {"name": str(tiny_qwen3_dir), "lora": {"rank": 4}},
            "output_dir": str(tmp_path / "run"),
            "max_steps": 2,
            "device": "cpu",
            "weights": {"transport": "filesystem", "track_changes": True},
        }
    )
    trainer = setup_trainer(config)
    try:
        with pytest.raises(ValueError, match="weights.track_changes"):
            WeightPublisher(trainer, config, adapters=True)
    finally:
        teardown_trainer(trainer)
