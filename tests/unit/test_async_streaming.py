"""Streamed chat completions: vLLM 0.32's chunk format (recorded from a real server), per-token version stamps,
completeness checks, tool-call deltas assembled into one message, and SSE decoding in the client."""

import asyncio
import json

import httpx
import pytest

from slipstream.envs.base import Task
from slipstream.orchestrator.client import InferenceClient
from slipstream.rollout.client import InferenceError
from slipstream.rollout.streaming import StreamedChat

TASK = Task(id="t0", prompt=[{"role": "user", "content": "hi"}])
PROMPT = [1, 317, 201, 74, 75, 2, 201, 1, 319, 201]
# Recorded from `vllm.entrypoints.openai.api_server` 0.32 (tiny qwen3, n=2, max_completion_tokens=4, logprobs,
# top_logprobs=0, return_token_ids, stream_options.include_usage); ids and created shortened.
RECORDED = [
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
     "prompt_token_ids": PROMPT, "prompt_text": None},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
     "prompt_token_ids": PROMPT, "prompt_text": None},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 0, "delta": {"content": " -"}, "logprobs": {"content": [
         {"token": " -", "logprob": -5.944221019744873, "bytes": [32, 45], "top_logprobs": []}]},
         "finish_reason": None, "token_ids": [343]}]},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 0, "delta": {"content": "j"}, "logprobs": {"content": [
         {"token": "j", "logprob": -5.046628952026367, "bytes": [106], "top_logprobs": []}]},
         "finish_reason": None, "token_ids": [76]}]},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 1, "delta": {"content": " bright"}, "logprobs": {"content": [
         {"token": " bright", "logprob": -6.240521430969238, "bytes": [32, 98, 114], "top_logprobs": []}]},
         "finish_reason": None, "token_ids": [430]}]},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": {"content": [
         {"token": "", "logprob": -3.983154058456421, "bytes": [], "top_logprobs": []}]},
         "finish_reason": None, "token_ids": [188]}]},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 1, "delta": {"content": "It"}, "logprobs": {"content": [
         {"token": "It", "logprob": -6.637145042419434, "bytes": [73, 116], "top_logprobs": []}]},
         "finish_reason": None, "token_ids": [306]}]},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": {"content": [
         {"token": "", "logprob": -5.648080825805664, "bytes": [], "top_logprobs": []}]},
         "finish_reason": "length", "stop_reason": None, "token_ids": [98]}]},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 1, "delta": {"content": " isn"}, "logprobs": {"content": [
         {"token": " isn", "logprob": -4.657876491546631, "bytes": [32, 105], "top_logprobs": []}]},
         "finish_reason": None, "token_ids": [316]}]},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
     "choices": [{"index": 1, "delta": {"content": ""}, "logprobs": {"content": [
         {"token": "", "logprob": -6.7822465896606445, "bytes": [], "top_logprobs": []}]},
         "finish_reason": "length", "stop_reason": None, "token_ids": [225]}]},
    {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny", "choices": [],
     "usage": {"prompt_tokens": 10, "total_tokens": 18, "completion_tokens": 8}, "system_fingerprint": "vllm-0.32.0"},
]  # fmt: skip


def assemble(chunks, versions) -> StreamedChat:
    """Feed chunks while the served version follows `versions` (one entry per chunk)."""
    clock = iter(versions)
    stream = StreamedChat(2, lambda: next(clock), "test")
    for chunk in chunks:
        stream.add(chunk)
    return stream


def test_recorded_vllm_stream_is_assembled_with_a_version_per_token():
    # The policy moves from version 3 to 4 after the fourth chunk arrived (a weight update mid-request).
    stream = assemble(RECORDED, [3] * 4 + [4] * 7)
    a, b = stream.rollouts(TASK, request_version=3)
    assert (a.prompt_token_ids, a.completion_token_ids, a.token_versions) == (PROMPT, [343, 76, 188, 98], [3, 3, 4, 4])
    assert (b.completion_token_ids, b.token_versions) == ([430, 306, 316, 225], [4, 4, 4, 4])
    assert a.completion_logprobs[:2] == [-5.944221019744873, -5.046628952026367]
    assert (a.completion_text, b.completion_text) == (" -j", " brightIt isn")
    assert (a.finish_reason, a.oldest_version, a.newest_version, b.oldest_version) == ("length", 3, 4, 4)
    assert assemble(RECORDED[:3], [3, 3, 5]).oldest_version == 5  # only the token's arrival counts


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda c: c[:-1], "no final usage chunk"),
        (lambda c: c[:-2] + c[-1:], r"ended before choices \[1\] finished"),
        (lambda c: c[2:], "no prompt_token_ids"),
        (lambda c: c[:-1] + [{**c[-1], "usage": {"completion_tokens": 9}}], "usage counts 9"),
    ],
)
def test_incomplete_streams_are_errors(mutate, match):
    chunks = mutate(json.loads(json.dumps(RECORDED)))
    with pytest.raises(InferenceError, match=match):
        assemble(chunks, [0] * len(chunks)).rollouts(TASK, 0)


def test_hidden_token_ids_and_missing_logprobs_are_errors():
    hidden = json.loads(json.dumps(RECORDED[2]))
    del hidden["choices"][0]["token_ids"]
    with pytest.raises(InferenceError, match="without token_ids"):
        assemble([hidden], [0])
    bad = json.loads(json.dumps(RECORDED[2]))
    bad["choices"][0]["logprobs"]["content"][0]["logprob"] = -9999.0
    with pytest.raises(InferenceError, match="without a log-prob"):
        assemble([bad], [0])
    late = json.loads(json.dumps(RECORDED[7]))  # choice 0 after its finish chunk
    with pytest.raises(InferenceError, match="after its finish_reason"):
        assemble([RECORDED[7], late], [0, 0])


def sse(chunks: list[dict], done: bool = True) -> bytes:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def stream_with(body: bytes, status: int = 200) -> list[dict]:
    async def main() -> list[dict]:
        async with InferenceClient("http://vllm", "tiny", request_timeout_s=5) as client:
            transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
            client._http = httpx.AsyncClient(base_url="http://vllm", transport=transport)
            return [c async for c in client.stream_chat(TASK.prompt, {}, 2, "policy-0")]

    return asyncio.run(main())


def test_client_decodes_server_sent_events():
    assert stream_with(sse(RECORDED)) == RECORDED
    with pytest.raises(InferenceError, match=r"without its final `data: \[DONE\]`"):
        stream_with(sse(RECORDED, done=False))
    error = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    with pytest.raises(InferenceError, match="error mid-stream.*boom"):
        stream_with(sse([RECORDED[0], error]))
    with pytest.raises(InferenceError, match="HTTP 400.*bad"):
        stream_with(b'{"error": "bad"}', status=400)


def test_streamed_tool_call_deltas_assemble_into_a_message():
    chat = StreamedChat(1, lambda: 3, "here")
    chat.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1, 2]})
    deltas = [
        {"content": "ok", "reasoning": "think"},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "calc"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"expression": '}}]},
        {
            "tool_calls": [
                {"index": 0, "function": {"arguments": '"1+1"}'}},
                {"index": 1, "id": "call_b", "function": {"name": "calc", "arguments": "{}"}},
            ]
        },  # fmt: skip
    ]
    for i, delta in enumerate(deltas):
        entry = {"logprob": -0.5}
        finish = "tool_calls" if i == len(deltas) - 1 else None
        choice = {"index": 0, "delta": delta, "logprobs": {"content": [entry]}, "token_ids": [10 + i]}
        chat.add({"choices": [choice | {"finish_reason": finish}]})
    chat.add({"choices": [], "usage": {"completion_tokens": 4}})
    turn = chat.model_turn("t")
    assert turn.message == {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "1+1"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "calc", "arguments": "{}"}},
        ],
        "reasoning_content": "think",
    }
    assert (turn.prompt_token_ids, turn.completion_token_ids, turn.completion_versions) == (
        [1, 2],
        [10, 11, 12, 13],
        [3] * 4,
    )
    assert turn.finish_reason == "tool_calls"


def test_stream_chunks_keep_unicode_line_separators_inside_json():
    """Generated text may hold U+2028 / U+0085, which JSON leaves unescaped: a chunk must not be cut there."""
    import httpx

    from slipstream.rollout.client import _sse_chunks

    texts = ["a\u2028b", "c\x85d\x1ce", "f\rg"]
    body = "".join(f"data: {json.dumps({'text': t}, ensure_ascii=False)}\r\n\r\n" for t in texts) + "data: [DONE]\n\n"

    async def scenario() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body.encode()))
        async with httpx.AsyncClient(transport=transport) as http, http.stream("GET", "http://x/") as response:
            return [chunk["text"] async for chunk in _sse_chunks(response, "test")]

    assert asyncio.run(scenario()) == texts
