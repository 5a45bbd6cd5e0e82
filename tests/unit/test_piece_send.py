"""One trainer rank's piece sender (weights/send/piece_send.py) in one process: it sends exactly the bytes of the gather
path's bucket assembly; a parameter whose rows changed after the sender was planned fails with a message instead of
sending misplaced bytes; models it cannot send piece by piece are named as such."""

import datetime

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

from slipstream.models.registry import build_model
from slipstream.weights.send.export import HFWeightStream
from slipstream.weights.send.piece_send import NotDirect, PieceSender
from slipstream.weights.wire.bucket_assembly import stream_to
from slipstream.weights.wire.stream import Manifest, plan_buckets
from tests.distributed.helpers import CollectBuckets


def _model(family: str = "qwen3"):
    spec = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3_moe":
        spec.update(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    config = AutoConfig.for_model(family, head_dim=8, vocab_size=64, **spec)
    torch.manual_seed(0)
    model = build_model(config, "custom")
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.normal_(0, 0.02).add_(0.01 * i)
    return model


def _group():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_one_rank_sends_the_bytes_of_the_gather_path(family):
    model = _model(family)
    stream = HFWeightStream(model, torch.bfloat16)
    buckets = tuple(plan_buckets(stream.metas(), 4096))
    sender = PieceSender(stream, buckets, 0, 1)
    manifest = sender.manifest(2)
    assert manifest.senders == 1 and all(b.rows is None for b in manifest.buckets) and len(buckets) > 2
    got, want = CollectBuckets(), CollectBuckets()
    for _ in range(2):  # the second version reuses the buffers and views planned by the first
        sender.send(_group(), torch.device("cpu"), got)
    stream_to(stream, Manifest(2, buckets), [want])
    assert got.buckets.keys() == want.buckets.keys()
    for i in want.buckets:
        assert torch.equal(got.buckets[i], want.buckets[i]), i


def test_buckets_prepared_ahead_are_sent_once_then_cast_again():
    """`prepare` casts the first buckets (one per slot) before the send; the send after it takes them as they are, and
    the next send without one casts every bucket from the weights of that moment."""
    model = _model()
    stream = HFWeightStream(model, torch.bfloat16)
    buckets = tuple(plan_buckets(stream.metas(), 4096))
    sender = PieceSender(stream, buckets, 0, 1)
    assert len(buckets) > 3  # more buckets than slots: the prepared slots are reused within the send

    def expected() -> CollectBuckets:
        want = CollectBuckets()
        stream_to(stream, Manifest(2, buckets), [want])
        return want

    for prepare in (True, False):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)  # a new version
        want, got = expected(), CollectBuckets()
        if prepare:
            sender.prepare(torch.device("cpu"))
            assert sender.ahead == 3
        sender.send(_group(), torch.device("cpu"), got)
        assert sender.ahead == 0
        assert got.buckets.keys() == want.buckets.keys()
        for i in want.buckets:
            assert torch.equal(got.buckets[i], want.buckets[i]), (prepare, i)


def test_the_send_after_prepare_does_not_cast_the_prepared_buckets_again():
    model = _model()
    stream = HFWeightStream(model, torch.bfloat16)
    buckets = tuple(plan_buckets(stream.metas(), 4096))
    sender = PieceSender(stream, buckets, 0, 1)
    before, got = CollectBuckets(), CollectBuckets()
    stream_to(stream, Manifest(2, buckets), [before])
    sender.prepare(torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    after = CollectBuckets()
    stream_to(stream, Manifest(2, buckets), [after])
    sender.send(_group(), torch.device("cpu"), got)
    for i in got.buckets:  # the first three as cast by prepare, the others from the weights at the send
        assert torch.equal(got.buckets[i], (before if i < 3 else after).buckets[i]), i
        assert not torch.equal(before.buckets[i], after.buckets[i]), i


def test_a_parameter_whose_rows_changed_is_refused():
    model = _model()
    stream = HFWeightStream(model, torch.bfloat16)
    sender = PieceSender(stream, tuple(plan_buckets(stream.metas(), 1 << 30)), 0, 1)
    model.norm.weight = torch.nn.Parameter(torch.ones(16))
    with pytest.raises(RuntimeError, match="weight of .*: this rank holds 16 rows where the sender planned 32"):
        sender.send(_group(), torch.device("cpu"))


def test_a_merged_lora_model_is_not_sent_piece_by_piece():
    from slipstream.models.common.lora import apply_lora

    model = _model()
    apply_lora(model, 4, 8, 0.0, ["q_proj"])
    with pytest.raises(NotDirect, match="LoRA"):
        PieceSender(HFWeightStream(model, torch.bfloat16), (), 0, 1)
