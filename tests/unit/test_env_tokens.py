"""Token-in/token-out across turns: prefix extension, loss masks, splitting where a template breaks the prefix.

Property tests (hypothesis) generate rollouts whose turn k+1 prompt either extends turn k's tokens or not, and check
the samples against an independent description of what they must hold; then the rollout driver is run end to end
with a toy chat template that is prefix-stable, and with one that drops earlier assistant turns.
"""

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.envs.base import Task
from slipstream.envs.driver_testing import assistant
from slipstream.envs.rollout import ModelTurn, run_rollout
from slipstream.envs.tokens import NO_VERSION, build_samples, extension
from slipstream.envs.wordle import WordleEnv


@dataclass
class Turn:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    completion_versions: list[int] | None = None


tokens = st.lists(st.integers(0, 50), max_size=6)


@st.composite
def rollouts(draw):
    """Turns plus, per turn after the first, whether its prompt extends the previous sample (the expectation)."""
    turns, extends = [], []
    running: list[int] = []
    for k in range(draw(st.integers(1, 6))):
        completion = draw(tokens)
        if k == 0 or not draw(st.booleans()):
            prompt = draw(st.lists(st.integers(0, 50), min_size=1, max_size=8))
            # A fresh prompt extends only by accident; record what actually happens.
            extends.append(k > 0 and prompt[: len(running)] == running and len(prompt) >= len(running))
        else:
            prompt = running + draw(tokens)
            extends.append(True)
        logprobs = [-0.5 - i for i in range(len(completion))]
        turns.append(Turn(prompt, completion, logprobs, [k] * len(completion)))
        running = (running if extends[-1] else []) + (prompt[len(running) :] if extends[-1] else prompt) + completion
    return turns, extends


@settings(max_examples=300, deadline=None, derandomize=True)
@given(rollouts())
def test_samples_hold_every_model_token_once_and_mask_everything_else(case):
    turns, extends = case
    build = build_samples(turns)
    assert build.num_prefix_breaks == sum(not e for e in extends[1:])
    assert len(build.samples) == 1 + build.num_prefix_breaks
    # Model tokens, in order across samples, are exactly the completions, with their logprobs and versions.
    model_tokens = [t for s in build.samples for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
    assert model_tokens == [t for turn in turns for t in turn.completion_token_ids]
    model_logprobs = [lp for s in build.samples for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m]
    assert model_logprobs == [lp for turn in turns for lp in turn.completion_logprobs]
    assert [t for s in build.samples for t in s.turn_indices] == list(range(len(turns)))
    for sample in build.samples:
        assert len(sample.token_ids) == len(sample.loss_mask) == len(sample.logprobs) == len(sample.versions)
        assert all(
            lp == 0.0 and v == NO_VERSION
            for lp, v, m in zip(sample.logprobs, sample.versions, sample.loss_mask, strict=True)
            if not m
        )
        # A sample is the last turn's prompt + completion, and every earlier turn's prompt + completion is a prefix.
        last = turns[sample.turn_indices[-1]]
        assert sample.token_ids == last.prompt_token_ids + last.completion_token_ids
        for index in sample.turn_indices:
            turn = turns[index]
            prefix = turn.prompt_token_ids + turn.completion_token_ids
            assert sample.token_ids[: len(prefix)] == prefix
            assert sample.loss_mask[len(turn.prompt_token_ids) : len(prefix)] == [True] * len(turn.completion_token_ids)
        # Turn k's tokens carry version k, so the oldest version is the first turn that generated tokens.
        generating = [i for i in sample.turn_indices if turns[i].completion_token_ids]
        assert sample.oldest_version == (min(generating) if generating else None)


@settings(derandomize=True)
@given(tokens, tokens)
def test_extension(previous, added):
    assert extension(previous, previous + added) == added
    if previous:
        assert extension(previous, previous[:-1]) is None
        assert extension(previous, [previous[0] + 1] + previous[1:] + added) is None


def test_errors_name_the_turn():
    with pytest.raises(ValueError, match="turn 1 carries no token ids"):
        build_samples([Turn([1], [2], [-0.1]), Turn(None, [3], [-0.1])])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="turn 0: 2 completion tokens but 1 logprobs"):
        build_samples([Turn([1], [2, 3], [-0.1])])
    with pytest.raises(ValueError, match="turn 0: 1 completion tokens but 2 versions"):
        build_samples([Turn([1], [2], [-0.1], [0, 0])])


class ToyServer:
    """A chat 'server' with a character-level tokenizer and a toy template; `keep_history=False` renders earlier
    assistant turns without their content (like templates that strip past reasoning), which breaks the prefix."""

    def __init__(self, keep_history: bool) -> None:
        self.keep_history = keep_history
        self.guesses = iter(["crane", "slate", "about"])

    def render(self, messages):
        text = ""
        for m in messages:
            content = m["content"] if m["role"] != "assistant" or self.keep_history else ""
            text += f"<{m['role']}>{content}</>"
        return [ord(c) for c in text + "<assistant>"]

    async def __call__(self, messages, tools):
        completion = f"<guess>{next(self.guesses)}</guess>"
        ids = [ord(c) for c in completion + "</>"]
        return ModelTurn(
            message=assistant(completion),
            prompt_token_ids=self.render(messages),
            completion_token_ids=ids,
            completion_logprobs=[-1.0] * len(ids),
            completion_versions=[7] * len(ids),
        )


@pytest.mark.parametrize("keep_history, num_samples", [(True, 1), (False, 3)])
def test_driver_turns_become_samples(keep_history, num_samples):
    env = WordleEnv(num_tasks=1, num_eval_tasks=0, max_guesses=3)
    task = Task(id="w", prompt=env.tasks("train")[0].prompt, answer="zebra")
    result = asyncio.run(run_rollout(env, task, ToyServer(keep_history)))
    build = build_samples(result.turns)
    assert (len(build.samples), build.num_prefix_breaks) == (num_samples, num_samples - 1)
    text = "".join(chr(t) for t, m in zip(build.samples[-1].token_ids, build.samples[-1].loss_mask, strict=True) if m)
    assert text.endswith("<guess>about</guess></>")
    if keep_history:
        sample = build.samples[0]
        assert "".join(chr(t) for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m) == "".join(
            f"<guess>{w}</guess></>" for w in ("crane", "slate", "about")
        )
        assert sample.oldest_version == 7
        feedback = "".join(chr(t) for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if not m)
        assert "Guess 1: crane" in feedback  # environment tokens are there, masked
