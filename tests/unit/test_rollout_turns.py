"""The one model-turn path (slipstream.rollout.turns) against a scripted streaming client: tools, per-turn seeds,
cache salts and sessions, per-token versions, the in-flight bound, and stop handling (context window full, timeout,
abort); single-turn groups streamed or as one whole reply (router replay); evaluation on a full context window."""

import asyncio

import pytest

from slipstream.config.orchestrator import SamplingConfig
from slipstream.envs.base import RewardResult, Task
from slipstream.envs.multiturn import MultiTurnEnv
from slipstream.envs.rollout import StopRollout, run_rollout
from slipstream.eval.tasks import evaluate_multi_turn_task, evaluate_single_turn_task
from slipstream.rollout.client import ContextLengthError, InferenceError
from slipstream.rollout.limiter import WeightedSemaphore
from slipstream.rollout.streaming import StreamedChat
from slipstream.rollout.turns import CONTEXT_LENGTH, TurnProgress, TurnRequester, sample_completions

TASK = Task(id="t0", prompt=[{"role": "user", "content": "hi"}])
TOOLS = [{"type": "function", "function": {"name": "calculate", "parameters": {}}}]


def token_chunk(index: int, token: int, text: str, finish: str | None = None, **delta) -> dict:
    entry = {"token": text, "logprob": -0.5 - token / 100, "top_logprobs": []}
    choice = {"index": index, "delta": {"content": text, **delta}, "logprobs": {"content": [entry]}}
    return {"choices": [choice | {"token_ids": [token], "finish_reason": finish}]}


class ScriptedClient:
    """A streaming client whose every request gets `reply(call) -> [(token, text, finish)]` per choice; a prompt of
    more than `max_messages` messages gets vLLM's context-length error. Records each call."""

    base_url = "http://scripted"
    request_timeout_s = 5.0

    def __init__(self, tokens=((7, "a", None), (8, "b", "stop")), max_messages=100, delay_s=0.0, on_token=None):
        self.tokens, self.max_messages, self.delay_s, self.on_token = list(tokens), max_messages, delay_s, on_token
        self.calls: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def stream_chat(self, messages, params, n, cache_salt, session=None):
        self.calls.append({"messages": list(messages), "params": dict(params), "n": n, "salt": cache_salt,
                           "session": session})  # fmt: skip
        if len(messages) > self.max_messages:
            raise ContextLengthError("POST /v1/chat/completions returned HTTP 400: maximum context length is 64")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield {"choices": [{"index": i, "delta": {"role": "assistant"}} for i in range(n)], "prompt_token_ids": [1]}
            for token, text, finish in self.tokens:
                await asyncio.sleep(self.delay_s)
                if self.on_token is not None:
                    self.on_token(token)
                for i in range(n):
                    yield token_chunk(i, token, text, finish)
            yield {"choices": [], "usage": {"completion_tokens": n * len(self.tokens)}}
        finally:
            self.in_flight -= 1

    async def chat(self, messages, params, n, cache_salt, session=None):
        self.calls.append({"messages": list(messages), "params": dict(params), "n": n, "salt": cache_salt})
        entries = [{"logprob": -1.0} for _ in self.tokens]
        choice = {"message": {"content": "".join(t for _, t, _ in self.tokens)}, "finish_reason": "stop"}
        choices = [choice | {"index": i, "token_ids": [t for t, _, _ in self.tokens], "logprobs": {"content": entries}}
                   for i in range(n)]  # fmt: skip
        return {"prompt_token_ids": [1], "choices": choices}


def requester(client, version=lambda: 3, limiter=None, timeout_s=5.0) -> TurnRequester:
    async def ready() -> int:
        return version()

    return TurnRequester(client, {"max_completion_tokens": 4}, timeout_s, ready, version, limiter)


def test_turns_send_tools_per_turn_seeds_one_session_and_stamp_each_token():
    versions = iter([3, 3, 4, 4, 5])  # read once per chunk: role chunk, 2 tokens, usage, ...
    client = ScriptedClient()
    progress = TurnProgress()
    model = requester(client, version=lambda: next(versions, 5)).model_fn(TASK, progress, lambda t: 100 + 10 * t)

    async def two_turns():
        return [await model([{"role": "user", "content": "hi"}], TOOLS), await model([], [])]

    first, second = asyncio.run(two_turns())
    assert first.message == {"role": "assistant", "content": "ab"} and first.finish_reason == "stop"
    assert (first.prompt_token_ids, first.completion_token_ids) == ([1], [7, 8])
    assert first.completion_logprobs == pytest.approx([-0.57, -0.58]) and first.completion_versions == [4, 4]
    call1, call2 = client.calls
    assert (call1["params"]["seed"], call1["params"]["tools"], call1["params"]["tool_choice"]) == (100, TOOLS, "auto")
    assert call2["params"]["seed"] == 110 and "tools" not in call2["params"]
    assert call1["n"] == call2["n"] == 1 and call1["salt"] == "policy-3"
    assert call1["session"] == call2["session"] is not None  # one rollout, one engine behind a router
    assert progress.oldest_version == 4


def test_a_turn_past_the_context_window_stops_its_rollout_normally():
    client = ScriptedClient(max_messages=2)
    with pytest.raises(StopRollout) as stop:
        asyncio.run(requester(client).model_fn(TASK)([{"role": "user"}] * 3, []))
    assert stop.value.reason == CONTEXT_LENGTH

    outcome = asyncio.run(run_rollout(ChatEnv(), TASK, requester(client).model_fn(TASK)))
    assert outcome.stop_reason == CONTEXT_LENGTH and len(outcome.turns) == 1 and outcome.reward.value == 1.0


def test_an_abort_or_a_timeout_is_an_error():
    aborted = ScriptedClient(tokens=[(7, "a", "abort")])
    with pytest.raises(InferenceError, match="finish_reason 'abort'"):
        asyncio.run(requester(aborted).model_fn(TASK)([], []))
    slow = ScriptedClient(delay_s=1.0)
    with pytest.raises(InferenceError, match="within request_timeout_s = 0.05s"):
        asyncio.run(requester(slow, timeout_s=0.05).model_fn(TASK)([], []))


def test_turns_stay_within_their_limiter():
    client = ScriptedClient(delay_s=0.01)
    turns = requester(client, limiter=WeightedSemaphore(2))

    async def many():
        await asyncio.gather(*(turns.model_fn(TASK)([], []) for _ in range(6)))

    asyncio.run(many())
    assert len(client.calls) == 6 and client.max_in_flight == 2


def test_single_turn_groups_stream_or_come_whole():
    client = ScriptedClient()
    chat = StreamedChat(2, lambda: 2, "scripted")
    streamed = asyncio.run(sample_completions(client, TASK, {}, 2, 1, chat))
    assert [r.token_versions for r in streamed] == [[2, 2], [2, 2]] and streamed[0].request_version == 1
    whole = asyncio.run(sample_completions(client, TASK, {}, 2, 1, None))
    assert [r.token_versions for r in whole] == [[1, 1], [1, 1]]  # a whole reply: the request's version
    assert [r.completion_text for r in whole] == ["ab", "ab"]
    with pytest.raises(ValueError, match="stream of 2 choices"):
        asyncio.run(sample_completions(client, TASK, {}, 3, 1, StreamedChat(2, lambda: 2, "scripted")))


class ChatEnv(MultiTurnEnv):
    """Replies "more" until the model has spoken three times; reward 1.0 whatever happened."""

    name = "chat"

    def __init__(self) -> None:
        super().__init__(max_turns=3)

    def tasks(self, split):
        return [TASK]

    async def setup_state(self, task):
        return {}

    async def env_response(self, messages, state):
        return [{"role": "user", "content": "more"}], False

    async def reward(self, task, state):
        return RewardResult(1.0)


def test_evaluation_on_a_full_context_window_reports_instead_of_raising():
    client = ScriptedClient(max_messages=2)
    sampling = SamplingConfig(max_tokens=4)
    multi = asyncio.run(evaluate_multi_turn_task(client, ChatEnv(), TASK, 2, sampling, 0, WeightedSemaphore(4), 3))
    assert multi.finish_reasons == [CONTEXT_LENGTH] * 2 and multi.errors == [None, None] and multi.rewards == [1.0] * 2
    assert {c["salt"] for c in client.calls} == {"policy-3"}

    class Echo:
        name = "echo"

        async def reward(self, task, completion):
            return 1.0

    too_long = Task(id="t1", prompt=[{"role": "user", "content": "x"}] * 3)
    single = asyncio.run(evaluate_single_turn_task(client, Echo(), too_long, 2, sampling, 0, WeightedSemaphore(4)))
    assert single.rewards == [0.0, 0.0] and single.finish_reasons == [f"error:{CONTEXT_LENGTH}"] * 2
    assert "maximum context length" in single.errors[0]
