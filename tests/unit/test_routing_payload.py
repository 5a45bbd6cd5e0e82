"""Router replay's payload: vLLM's base64 .npy routed experts decoded and checked, aligned with a sample's tokens,
packed per micro-batch in a compact dtype (one byte per expert id up to 254 experts, NO_ROUTE where inference did
not route), decoded by the trainer to -1; replies without routing and bad configs are refused with the fix."""

import base64
import io
import itertools

import numpy as np
import pytest

from slipstream.config.loader import ConfigError, deep_merge, validate_config
from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.config.rl import RLConfig
from slipstream.envs.base import Task
from slipstream.orchestrator.batching import build_training_batches
from slipstream.orchestrator.routing import align_routing, decode_routed_experts, pack_routing
from slipstream.rollout.client import InferenceError
from slipstream.rollout.replies import parse_chat_response
from slipstream.trainer.data import MicroBatchError, routing_tensor, to_packed
from slipstream.transport.rollouts import Routing


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def _reply(num_prompt: int, completions: list[list[int]], routed: list[np.ndarray | None]) -> dict:
    choices = []
    for i, (ids, r) in enumerate(zip(completions, routed, strict=True)):
        choice = {
            "index": i,
            "token_ids": ids,
            "logprobs": {"content": [{"logprob": -1.0} for _ in ids]},
            "message": {"content": "x"},
            "finish_reason": "stop",
        }
        if r is not None:
            choice["routed_experts"] = _npy(r)
        choices.append(choice)
    return {"prompt_token_ids": list(range(1, num_prompt + 1)), "choices": choices}


def test_decode_keeps_vllm_layout_in_a_compact_dtype_and_refuses_bad_data():
    routed = np.array([[[0, 7], [3, 1]], [[2, 2], [6, 5]]], dtype=np.int32)
    got = decode_routed_experts(_npy(routed), "here")
    assert got.dtype == np.uint8 and np.array_equal(got, routed)
    assert decode_routed_experts(_npy(routed * 100), "here").dtype == np.uint16  # ids up to 700
    with pytest.raises(ValueError, match="not base64 .npy"):
        decode_routed_experts("!!!", "here")
    with pytest.raises(ValueError, match="3-d integer"):
        decode_routed_experts(_npy(np.zeros((2, 2))), "here")
    with pytest.raises(ValueError, match="negative"):
        decode_routed_experts(_npy(-routed - 1), "here")


def test_routing_travels_with_the_tokens_into_the_trainer():
    task = Task(id="t", prompt=[{"role": "user", "content": "hi"}])
    rng = np.random.default_rng(0)
    routed = [rng.integers(0, 8, (3 + n - 1, 2, 2)) for n in (4, 2)]  # vLLM: prompt + completion - 1 rows
    reply = _reply(3, [[11, 12, 13, 14], [21, 22]], routed)
    rollouts = parse_chat_response(reply, task, 2, 0, require_routed_experts=True)
    for i, r in enumerate(rollouts):
        r.advantage = 1.0 - 2 * i
    (batch,) = build_training_batches(1, rollouts, 1.0, micro_batch_tokens=64, num_ranks=1, metrics={})
    (mb,) = batch.micro_batches
    assert mb.routing is not None and mb.routing.dtype == "uint8" and len(mb.routing.data) == len(mb.input_ids) * 4
    replay_TRA = to_packed(mb, "cpu").replay_TRA
    starts = [i for i, p in enumerate(mb.position_ids) if p == 0] + [len(mb.input_ids)]
    for start, end in itertools.pairwise(starts):
        n = end - start
        want = next(r for r in routed if r.shape[0] == n - 1)  # samples are packed longest first
        assert np.array_equal(replay_TRA[start : end - 1].numpy(), want)
        assert (replay_TRA[end - 1] == -1).all()  # the last token has no routing


def test_samples_without_routing_and_wider_dtypes_pack_together():
    a = align_routing(np.full((2, 1, 2), 3, dtype=np.uint8), 3, "a")
    b = align_routing(np.full((1, 1, 2), 300, dtype=np.uint16), 2, "b")
    routing = pack_routing([a, None, b], [3, 2, 2])
    values = routing_tensor(routing, 7, "cpu")
    assert routing.dtype == "uint16" and values[:, 0, 0].tolist() == [3, 3, -1, -1, -1, 300, -1]
    assert pack_routing([None, None], [2, 2]) is None
    with pytest.raises(ValueError, match="different"):
        pack_routing([a, align_routing(np.zeros((1, 2, 2), np.uint8), 2, "c")], [3, 2])
    with pytest.raises(ValueError, match="rows for a sample"):
        align_routing(np.zeros((5, 1, 2), np.uint8), 3, "d")
    with pytest.raises(MicroBatchError, match="not \\(7, 1, 2\\)"):
        routing_tensor(Routing(b"\x00" * 6, "uint8", 1, 2), 7, "cpu")


def test_a_reply_without_routing_is_refused_when_replay_is_on():
    task = Task(id="t", prompt=[{"role": "user", "content": "hi"}])
    reply = _reply(2, [[5, 6]], [None])
    assert parse_chat_response(reply, task, 1, 0)[0].routed_experts is None
    with pytest.raises(InferenceError, match="enable_return_routed_experts"):
        parse_chat_response(reply, task, 1, 0, require_routed_experts=True)
    too_long = _reply(2, [[5, 6]], [np.zeros((9, 1, 2), dtype=np.int64)])
    with pytest.raises(InferenceError, match="9 rows for 4 tokens"):
        parse_chat_response(too_long, task, 1, 0, require_routed_experts=True)


def test_config_asks_for_the_vllm_flag():
    base = {"inference_url": "http://x", "output_dir": "/tmp/x", "model": {"name": "m"}, "max_steps": 1}
    assert OrchestratorConfig.model_validate({**base, "router_replay": True}).router_replay
    rl = {"max_steps": 1, "model": {"name": "m"}, "orchestrator": {"router_replay": True}}
    with pytest.raises(ConfigError, match="enable_return_routed_experts = true"):
        validate_config(RLConfig, rl)
    ok = validate_config(RLConfig, deep_merge(rl, {"inference": {"enable_return_routed_experts": True}}))
    assert ok.orchestrator.router_replay and ok.inference.enable_return_routed_experts
