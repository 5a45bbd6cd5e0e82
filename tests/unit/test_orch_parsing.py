"""Parsing of vLLM replies (token-in/token-out), the request limiter and deterministic task sampling."""

import asyncio

import pytest

from slipstream.envs.base import Task
from slipstream.orchestrator.sampler import TaskSampler
from slipstream.rollout.client import InferenceError, parse_prompt_logprobs
from slipstream.rollout.limiter import WeightedSemaphore
from slipstream.rollout.replies import parse_chat_response

TASK = Task(id="t0", prompt=[{"role": "user", "content": "abc"}])


def chat_reply(token_ids, logprobs, prompt_ids=(1, 2, 3)):
    content = [{"token": "x", "logprob": lp, "top_logprobs": []} for lp in logprobs]
    choice = {"index": 0, "message": {"content": "cba"}, "logprobs": {"content": content}, "token_ids": token_ids}
    return {"choices": [choice], "prompt_token_ids": list(prompt_ids)}


def test_chat_reply_is_taken_verbatim():
    (r,) = parse_chat_response(chat_reply([7, 8], [-0.5, -1.5]), TASK, 1, policy_version=4)
    assert (r.prompt_token_ids, r.completion_token_ids, r.completion_logprobs) == ([1, 2, 3], [7, 8], [-0.5, -1.5])
    assert (r.completion_text, r.request_version, r.token_versions) == ("cba", 4, [4, 4])


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (chat_reply([7, 8], [-0.5]), "2 token ids but 1 logprobs"),
        (chat_reply([7], [-9999.0]), "without a log-prob"),
        (chat_reply(None, [-0.5]), "lacks token_ids"),
        (chat_reply([7], [-0.5], prompt_ids=()), "prompt_token_ids"),
    ],
)
def test_bad_chat_replies(reply, match):
    with pytest.raises(InferenceError, match=match):
        parse_chat_response(reply, TASK, 1, 0)


def test_wrong_number_of_choices():
    with pytest.raises(InferenceError, match="asked for 2"):
        parse_chat_response(chat_reply([7], [-0.5]), TASK, 2, 0)


def test_prompt_logprobs_pick_the_actual_token():
    entries = [None, {"5": {"logprob": -1.0}, "9": {"logprob": -0.1}}, {"6": {"logprob": -2.0}}]
    reply = {"choices": [{"prompt_logprobs": entries}]}
    assert parse_prompt_logprobs(reply, [4, 5, 6], "here") == [-1.0, -2.0]
    with pytest.raises(InferenceError, match="lacks the prompt token 7"):
        parse_prompt_logprobs(reply, [4, 5, 7], "here")
    with pytest.raises(InferenceError, match="prompt of 2 tokens"):
        parse_prompt_logprobs(reply, [4, 5], "here")


def test_weighted_semaphore_bounds_completions():
    async def main():
        limiter, running, peak = WeightedSemaphore(5), [0], [0]

        async def job(units):
            taken = await limiter.acquire(units)
            running[0] += taken
            peak[0] = max(peak[0], running[0])
            await asyncio.sleep(0.01)
            running[0] -= taken
            await limiter.release(taken)

        await asyncio.gather(*(job(u) for u in [3, 3, 2, 8, 1]))
        return peak[0]

    assert asyncio.run(main()) <= 5


def test_sampler_is_deterministic_and_covers_epochs():
    tasks = [Task(id=str(i), prompt=[]) for i in range(10)]
    a, b = TaskSampler(tasks, 4, seed=3), TaskSampler(tasks, 4, seed=3)
    steps_a = [[t.id for t in a.tasks_for_step(s)] for s in range(1, 6)]
    assert steps_a == [[t.id for t in b.tasks_for_step(s)] for s in range(1, 6)]
    flat = [i for step in steps_a for i in step]
    assert sorted(flat[:10]) == [str(i) for i in range(10)]  # epoch 0 visits every task once
    assert sorted(flat[10:20]) == [str(i) for i in range(10)]
    assert flat[:10] != flat[10:20]  # reshuffled per epoch
    assert [t.id for t in TaskSampler(tasks, 4, seed=3).tasks_for_step(4)] == steps_a[3]  # resumable
    assert [t.id for t in TaskSampler(tasks, 4, seed=4).tasks_for_step(1)] != steps_a[0]
