"""Property-based: malformed input on every other wire Slipstream reads (config and batch files: test_property_inputs.py)
gives the receiver's documented error naming the file or field, never a raw exception, a hang or a half-written file.

Wires: micro-batches with router replay (trainer), weight manifests, update_info and init_info (inference), marker
files of the weight hand-over, probes, trainer progress, step logs and the orchestrator's state (resume), vLLM's
replies as the orchestrator parses them (chat, prompt log-probs, SSE streams, /metrics, routed experts), and the
admin and weight-transfer endpoints with and without the admin token. Each bug found is kept as an @example.
"""

import asyncio
import base64
import io
import json
import math
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from slipstream.envs.base import Task
from slipstream.inference.admin_token import HEADER
from slipstream.inference.auth import AdminTokenMiddleware, is_open_path
from slipstream.orchestrator.concurrency import parse_server_load
from slipstream.orchestrator.routing import decode_routed_experts
from slipstream.orchestrator.state import OrchestratorState, load_state, save_state
from slipstream.rollout.client import InferenceError, _sse_chunks, parse_prompt_logprobs
from slipstream.rollout.replies import parse_chat_response
from slipstream.rundir import RunDir
from slipstream.trainer.ckpt import read_progress
from slipstream.trainer.data import MicroBatchError, to_packed
from slipstream.transport.checkpoints import truncate_step_log
from slipstream.transport.rollouts import BatchFormatError, MicroBatch, Routing, read_batch
from slipstream.weights.receive.receiver import WeightReceiver
from slipstream.weights.wire.collective import GroupInit
from slipstream.weights.wire.offers import ACCEPT, MANIFEST, OFFER, read_accept, read_manifest, read_offer
from slipstream.weights.wire.published import read_probe, weights_dir
from slipstream.weights.wire.stream import Manifest, TensorMeta, plan_buckets
from slipstream_sim import SimConfig, SimServer

# derandomize: CI runs the same examples every time (a failure reproduces); new inputs come from changing the tests
FAST = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
CPU = torch.device("cpu")

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
DEEP = "[" * 100_000  # oversized: nested past Python's recursion limit
BAD_JSON = [b"", b"\xff\xfe\x00", b"{", b'{"step": 1', DEEP.encode(), b"NaN", b"[1, 2]", b'"text"']


def mutate(data: object, path: list, value: object) -> object:
    """`data` with the node reached by following `path` (indices taken modulo the sizes) replaced by `value`."""
    if not path or not isinstance(data, dict | list) or not data:
        return value
    keys = list(data) if isinstance(data, dict) else list(range(len(data)))
    key = keys[path[0] % len(keys)]
    copy = dict(data) if isinstance(data, dict) else list(data)
    copy[key] = mutate(copy[key], path[1:], value)
    return copy


paths = st.lists(st.integers(min_value=0, max_value=7), max_size=5)


# -- micro-batches (trainer): to_packed and router replay ---------------------------------------------------------
def micro_batch(n: int, routing: Routing | None = None, **values) -> MicroBatch:
    fields = {
        "input_ids": list(range(n)),
        "position_ids": list(range(n)),
        "loss_mask": [False] + [True] * (n - 1),
        "advantages": [0.5] * n,
        "inference_logprobs": [-1.0] * n,
        "temperatures": [1.0] * n,
    }
    return MicroBatch(**(fields | values), routing=routing)


big_ints = st.integers(min_value=-(2**64), max_value=2**64 - 1)
any_floats = st.floats(allow_nan=True, allow_infinity=True)


@FAST
@given(
    n=st.integers(min_value=1, max_value=6),
    field=st.sampled_from(["input_ids", "position_ids", "advantages", "inference_logprobs", "temperatures"]),
    value=st.one_of(big_ints, any_floats),
    at=st.integers(min_value=0, max_value=5),
)
@example(n=1, field="input_ids", value=2**63, at=0)  # was ValueError: Overflow when unpacking long long
@example(n=2, field="temperatures", value=math.nan, at=1)  # was accepted: a NaN loss
@example(n=2, field="advantages", value=math.inf, at=1)  # was accepted: an inf loss
@example(n=3, field="position_ids", value=-1, at=2)
def test_a_micro_batch_with_bad_values_is_a_micro_batch_error(n, field, value, at):
    values = micro_batch(n).__getattribute__(field)
    if field in ("input_ids", "position_ids") and not isinstance(value, int):
        value = int(value) if math.isfinite(value) else 2**64 - 1
    values = [*values[: at % n], value, *values[at % n + 1 :]]
    try:
        to_packed(micro_batch(n, **{field: values}), CPU)
    except MicroBatchError as e:
        assert str(e)


@FAST
@given(
    n=st.integers(min_value=1, max_value=5),
    data=st.binary(max_size=64),
    dtype=st.one_of(st.sampled_from(["uint8", "uint16", "int64", "float32", "object", ""]), st.text(max_size=6)),
    num_layers=st.integers(min_value=-3, max_value=4),
    top_k=st.integers(min_value=-3, max_value=4),
)
@example(n=2, data=b"\x00" * 4, dtype="uint8", num_layers=-1, top_k=-2)  # was RuntimeError: invalid shape dimension
@example(n=2, data=b"\x00" * 3, dtype="uint16", num_layers=1, top_k=1)  # was ValueError: buffer size must be ...
@example(n=1, data=b"", dtype="uint8", num_layers=0, top_k=0)
def test_malformed_router_replay_is_a_micro_batch_error(n, data, dtype, num_layers, top_k):
    try:
        packed = to_packed(micro_batch(n, Routing(data, dtype, num_layers, top_k)), CPU)
    except MicroBatchError as e:
        assert "routing" in str(e), str(e)
    else:
        assert packed.replay_TRA is not None and packed.replay_TRA.shape == (n, num_layers, top_k)


@FAST
@given(routing=json_values)
def test_a_batch_file_with_a_malformed_routing_payload_is_refused(tmp_path, routing):
    raw = msgspec.to_builtins(micro_batch(3))
    raw["routing"] = routing
    path = tmp_path / "rank_0.msgpack"
    batch = {"step": 1, "rank": 0, "num_loss_tokens": 2, "micro_batches": [raw]}
    try:
        path.write_bytes(msgspec.msgpack.encode(batch))
    except OverflowError:
        return  # an integer msgpack cannot carry
    try:
        to_packed(read_batch(path).micro_batches[0], CPU)
    except BatchFormatError as e:
        assert str(path) in str(e)
    except MicroBatchError as e:
        assert "routing" in str(e)


# -- weight manifests, update_info and init_info (inference side of the weight hand-over) --------------------------
VALID_MANIFEST = Manifest(
    3, tuple(plan_buckets([TensorMeta("a.weight", "bfloat16", (2, 3)), TensorMeta("b", "float32", (4,))], 64))
).to_dict()


@FAST
@given(path=paths, value=json_values)
@example(path=[], value={"version": 1})  # was KeyError: 'buckets'
@example(path=[], value=[1])  # was AttributeError: 'list' object has no attribute 'get'
@example(path=[2, 0, 0], value="nope")  # a bucket's dtype: was AttributeError: module 'torch' has no attribute
@example(path=[1], value="x")  # step: was ValueError: invalid literal for int()
@example(path=[2, 0, 1, 0, 1], value=[-1])
def test_a_malformed_manifest_is_a_value_error_naming_the_field(path, value):
    data = mutate(VALID_MANIFEST, path, value)
    try:
        manifest = Manifest.from_dict(data)
    except ValueError as e:
        assert "weight manifest" in str(e), str(e)
    else:
        assert manifest.nbytes >= 0 and Manifest.from_dict(manifest.to_dict()) == manifest


@FAST
@given(update_info=json_values, manifest_path=paths, manifest_value=json_values)
@example(update_info={"step": "x", "path": "/nowhere"}, manifest_path=[], manifest_value=None)
@example(update_info={"step": 1, "path": 5}, manifest_path=[], manifest_value=None)  # was TypeError from Path(5)
def test_a_malformed_update_info_is_a_value_error_before_anything_is_received(
    tmp_path, update_info, manifest_path, manifest_value
):
    receiver = WeightReceiver(CPU)
    if isinstance(update_info, dict) and "manifest" in update_info:
        update_info["manifest"] = mutate(VALID_MANIFEST, manifest_path, manifest_value)
    loaded = []
    with pytest.raises((ValueError, RuntimeError, FileNotFoundError)) as e:
        receiver.receive(update_info, loaded.append)
    assert not loaded and any(word in str(e.value) for word in ("update_info", "manifest", "folder")), str(e.value)


_GOOD_INIT = {"backend": "gloo", "master_addr": "h", "master_port": 1, "session": "s", "world_size": 2}
"""A well-formed init_info; the examples below each break one field of it."""


@FAST
@given(init_info=st.dictionaries(st.sampled_from(list(GroupInit.__dataclass_fields__)), json_values))
@example(init_info={**_GOOD_INIT, "master_port": "x"})
@example(init_info={**_GOOD_INIT, "rank_offset": 5})
@example(init_info={**_GOOD_INIT, "timeout_s": math.inf})
@example(init_info={**_GOOD_INIT, "world_size": 4, "rank_offset": 2, "senders": 3})
@example(init_info={**_GOOD_INIT, "receive_buffers": 1})
@example(init_info={**_GOOD_INIT, "receive_buffers": True})
def test_a_malformed_init_info_is_refused_before_joining(init_info):
    """`master_port: "x"` used to pass and make the worker wait on a store it can never reach."""
    try:
        init = GroupInit(**init_info)
    except TypeError as e:  # a missing field
        assert "missing" in str(e) and "argument" in str(e), str(e)
    except ValueError as e:
        assert "init_info" in str(e) or "weight transfer" in str(e), str(e)
    else:
        assert 0 < init.master_port < 65536 and 1 <= init.rank_offset < init.world_size and init.timeout_s > 0
        assert 1 <= init.senders <= init.rank_offset and init.receive_buffers >= 2


# -- marker files: the weight hand-over, probes, trainer progress, step logs, orchestrator state -------------------
def marker_readers(out: Path):
    step_dir = weights_dir(out, 1)
    return [
        (step_dir / ACCEPT, lambda: read_accept(out, 1)),
        (step_dir / OFFER, lambda: read_offer(out, 1)),
        (step_dir / MANIFEST, lambda: read_manifest(out, 1)),
        (RunDir(out).probe_path(1), lambda: read_probe(out, 1)),
        (out / "progress.json", lambda: read_progress(out / "progress.json")),
    ]


@FAST
@given(which=st.integers(min_value=0, max_value=4), data=st.one_of(st.binary(max_size=100), st.sampled_from(BAD_JSON)))
@example(which=0, data=b'{"session": 1}')  # was TypeError: missing world_size
@example(which=1, data=b"{}")  # read_offer's caller: was KeyError: 'backend'
@example(which=3, data=b'{"token_ids": [1, 2], "logprobs": [NaN]}')  # NaN passed the weight check's comparison
@example(which=4, data=b'{"step": 1}')  # load_checkpoint: was KeyError: 'model_type'
@example(which=4, data=DEEP.encode())  # was RecursionError
def test_random_bytes_in_a_marker_file_are_a_value_error_naming_it(tmp_path_factory, which, data):
    out = tmp_path_factory.mktemp("run")
    path, read = marker_readers(out)[which]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    try:
        read()
    except ValueError as e:
        assert str(path) in str(e), str(e)


VALID_MARKERS = [
    {"session": "abc", "world_size": 2},
    {"step": 1, "backend": "gloo"},
    VALID_MANIFEST,
    {"token_ids": [1, 2, 3], "logprobs": [-1.0, -2.0]},
    {"format_version": 1, "world_size": 2, "step": 1, "model_type": "llama", "impl": "custom"},
]


@FAST
@given(which=st.integers(min_value=0, max_value=4), path=paths, value=json_values)
def test_wrong_types_in_a_marker_file_are_a_value_error_naming_it(tmp_path_factory, which, path, value):
    out = tmp_path_factory.mktemp("run")
    file, read = marker_readers(out)[which]
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(mutate(VALID_MARKERS[which], path, value)))
    try:
        read()
    except ValueError as e:
        assert str(file) in str(e), str(e)


@FAST
@given(
    lines=st.lists(st.one_of(st.builds(json.dumps, json_values), st.text(max_size=20)), max_size=6),
    keep=st.integers(0, 3),
)
@example(lines=['{"step": 1}', "[1]", '{"step": 2}'], keep=1)  # was TypeError: list indices must be integers
@example(lines=['{"step": 1}', '{"loss": 2}'], keep=1)  # was KeyError: 'step'
def test_a_malformed_step_log_is_refused_at_resume_and_left_as_it_was(tmp_path, lines, keep):
    path = tmp_path / "metrics.jsonl"
    text = "".join(f"{line}\n" for line in lines).encode(errors="surrogatepass")
    path.write_bytes(text)
    try:
        dropped = truncate_step_log(path, keep)
    except ValueError as e:
        assert f"{path}:" in str(e) and path.read_bytes() == text, str(e)  # nothing rewritten
    else:
        assert dropped >= 0 and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


STATE = OrchestratorState(
    step=2, seed=0, env_name="arith", tasks_per_step=4, next_task_index=8, requeued_task_indices=[6],
    num_dispatched=9, num_cancelled=0, num_dropped=0, num_failed=0, num_abandoned=0, failed_rollouts_by_stage={},
)  # fmt: skip


@FAST
@given(
    cut=st.integers(min_value=0, max_value=10_000),
    path=paths,
    value=json_values,
    junk=st.one_of(st.binary(max_size=60), st.sampled_from(BAD_JSON)),
)
def test_a_malformed_orchestrator_state_is_a_value_error_naming_the_file(tmp_path_factory, cut, path, value, junk):
    out = tmp_path_factory.mktemp("run")
    file = save_state(out, STATE) / "state.json"
    encoded = file.read_bytes()
    for data in (encoded[: cut % len(encoded)], json.dumps(mutate(msgspec.to_builtins(STATE), path, value)), junk):
        file.write_bytes(data.encode() if isinstance(data, str) else data)
        try:
            load_state(out, 2, seed=0, env_name="arith", tasks_per_step=4)
        except ValueError as e:
            assert str(file) in str(e), str(e)


# -- vLLM's replies, as the orchestrator parses them ---------------------------------------------------------------
TASK = Task(id="t0", prompt="p")


def routed(rows: int) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((rows, 2, 2), dtype=np.uint8))
    return base64.b64encode(buffer.getvalue()).decode()


VALID_REPLY = {
    "prompt_token_ids": [1, 2],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ab"},
            "token_ids": [3, 4],
            "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]},
            "finish_reason": "stop",
            "token_versions": [0, 0],
            "routed_experts": routed(3),
        }
    ],
}


@FAST
@given(path=paths, value=json_values)
@example(path=[], value=[])  # was AttributeError: 'list' object has no attribute 'get'
@example(path=[1, 0], value={"token_ids": [1]})  # was KeyError: 'index'
@example(path=[1, 0, 3, 0, 1], value=[])  # a logprobs.content entry: was TypeError
@example(path=[1, 0, 3, 0, 0], value=math.nan)  # a NaN logprob was accepted
@example(path=[1, 0, 5, 0], value="0")  # token_versions: was TypeError: '<' not supported
@example(path=[1, 0, 6], value=5)  # routed_experts: was TypeError from base64
def test_a_malformed_chat_reply_is_an_inference_error(path, value):
    reply = mutate(VALID_REPLY, path, value)
    try:
        (rollout,) = parse_chat_response(reply, TASK, 1, 0, require_routed_experts=True)
    except InferenceError as e:
        assert str(e)
    else:
        assert all(isinstance(t, int) for t in rollout.prompt_token_ids + rollout.completion_token_ids)
        assert all(math.isfinite(lp) for lp in rollout.completion_logprobs)
        assert isinstance(rollout.completion_text, str)


@FAST
@given(reply=json_values, token_ids=st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=4))
@example(reply={"choices": [{"prompt_logprobs": [None, 5]}]}, token_ids=[1, 2])  # was AttributeError
@example(reply={"choices": [{"prompt_logprobs": [None, {"2": 1}]}]}, token_ids=[1, 2])  # was TypeError
@example(reply={"choices": [{"prompt_logprobs": [None, {"2": {"logprob": "x"}}]}]}, token_ids=[1, 2])  # ValueError
def test_malformed_prompt_logprobs_are_an_inference_error(reply, token_ids):
    try:
        logprobs = parse_prompt_logprobs(reply, token_ids, "sim")
    except InferenceError as e:
        assert "sim" in str(e)
    else:
        assert len(logprobs) == len(token_ids) - 1 and all(math.isfinite(lp) for lp in logprobs)


async def collect_chunks(body: bytes) -> list[dict]:
    response = httpx.Response(200, content=body)
    return [chunk async for chunk in _sse_chunks(response, "stream")]


@FAST
@given(
    events=st.lists(st.one_of(st.builds(json.dumps, json_values), st.text(max_size=12), st.just("[DONE]")), max_size=5),
    tail=st.binary(max_size=20),
)
@example(events=["5"], tail=b"")  # was TypeError: argument of type 'int' is not iterable
@example(events=["null"], tail=b"")
@example(events=[DEEP], tail=b"")  # was RecursionError
def test_a_malformed_event_stream_is_an_inference_error_and_ends(events, tail):
    body = "".join(f"data: {event}\n\n" for event in events).encode() + tail
    try:
        chunks = asyncio.run(asyncio.wait_for(collect_chunks(body), timeout=10))
    except InferenceError as e:
        assert str(e).startswith("stream")
    else:
        assert all(isinstance(c, dict) for c in chunks)


@FAST
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=100).map(lambda b: b.decode("latin-1"))))
@example(text='vllm:num_requests_waiting{a="b"} x\n')
@example(text="vllm:num_requests_waiting 1 2 3 4\n")
def test_a_malformed_metrics_page_is_an_inference_error(text):
    try:
        load = parse_server_load(text, "GET /metrics")
    except InferenceError as e:
        assert "/metrics" in str(e)
    else:
        assert isinstance(load.num_waiting, float)


@FAST
@given(data=st.one_of(st.binary(max_size=200), st.sampled_from([b"\x93NUMPY\x01\x00\x10\x00{'descr': '|O'"])))
@example(data=b"")  # was EOFError: No data left in file
def test_malformed_routed_experts_are_a_value_error(data):
    for encoded in (base64.b64encode(data).decode(), data.decode("latin-1")):
        try:
            decode_routed_experts(encoded, "choice 0")
        except ValueError as e:
            assert str(e).startswith("choice 0")


# -- the admin and weight-transfer endpoints, with and without the token ------------------------------------------
ADMIN_ROUTES = ["/pause", "/resume", "/reset_prefix_cache", "/init_weight_transfer_engine", "/start_weight_update",
                "/update_weights", "/finish_weight_update", "/get_world_size"]  # fmt: skip
OPEN_ROUTES = ["/v1/chat/completions", "/v1/completions", "/health", "/metrics"]
TOKEN = "s3cret-token"
small_ints = st.integers(min_value=-2, max_value=4)
chat_like = st.fixed_dictionaries(
    {"messages": st.one_of(json_values, st.just([{"role": "user", "content": "hi"}]))},
    optional={"model": json_values, "n": small_ints, "max_tokens": small_ints, "max_completion_tokens": small_ints,
              "prompt": st.one_of(json_values, st.just([1, 2])), "prompt_logprobs": small_ints,
              "seed": st.one_of(st.none(), small_ints), "logprobs": json_values, "return_token_ids": json_values,
              "init_info": json_values, "weight_version": json_values,
              "update_info": st.one_of(json_values, st.just({"step": 1, "manifest": VALID_MANIFEST}))},
)  # fmt: skip
bodies = st.one_of(chat_like.map(lambda b: json.dumps(b).encode()), st.binary(max_size=60), st.sampled_from(BAD_JSON))


@FAST
@given(
    route=st.sampled_from(ADMIN_ROUTES + OPEN_ROUTES),
    body=bodies,
    token=st.sampled_from([None, TOKEN, "wrong", ""]),
    started=st.booleans(),
    mode=st.one_of(st.none(), st.text(max_size=6), st.sampled_from(["abort", "wait", "keep"])),
)
@example(route="/update_weights", body=b'{"update_info": {"step": 1, "path": 5}}', token=TOKEN, started=True, mode=None)
@example(
    route="/update_weights", body=b'{"update_info": {"step": "x", "path": "/w"}}', token=TOKEN, started=True, mode=None
)  # was 500: ValueError: invalid literal for int()
@example(
    route="/init_weight_transfer_engine",
    body=b'{"init_info": {"backend": "gloo", "master_addr": "h", "master_port": 1, "session": "s", "world_size": 2, '
    b'"rank_offset": 2}}',
    token=TOKEN,
    started=False,
    mode=None,
)  # was 500: ValueError from join (rank outside the group)
@example(
    route="/v1/chat/completions", body=b"\x80", token=None, started=False, mode=None
)  # was 500: UnicodeDecodeError
@example(route="/v1/chat/completions", body=DEEP.encode(), token=None, started=False, mode=None)
def test_every_endpoint_answers_malformed_requests_with_a_client_error(route, body, token, started, mode):
    started = started and route not in OPEN_ROUTES  # a paused server holds generation requests until /resume
    server = SimServer(SimConfig(default_max_tokens=4))
    app = AdminTokenMiddleware(server.app, token=TOKEN)
    headers = {} if token is None else {HEADER: token}
    method = "GET" if route in ("/health", "/metrics", "/get_world_size") else "POST"
    with TestClient(app) as client:
        if started:  # reach /update_weights' parsing
            for step in ("/pause", "/start_weight_update"):
                assert client.post(step, headers={HEADER: TOKEN}).status_code == 200
        params = {} if mode is None else {"mode": mode}
        response = client.request(method, route, content=body, headers=headers, params=params)
    if not is_open_path(route) and token != TOKEN:
        assert response.status_code == 401 and server.transfer.active == started, response.text
        return
    assert response.status_code in (200, 400, 404, 405), (response.status_code, response.text)
    if response.status_code == 400:
        assert response.json()["message"]
