"""Token-in/token-out across turns: training samples of a multi-turn rollout from the exact token ids inference saw.

Turn k+1's prompt must extend turn k's tokens (prompt + completion) exactly; then both turns share one sample and
the tokens in between (environment messages, tool results, template scaffolding) are masked. Where a chat template
breaks the prefix (re-renders or strips earlier assistant turns, re-tokenizes differently), the rollout is split into
separate samples at that turn and the break is counted. Earlier turns are never re-tokenized. Pure: no HTTP, no
tokenizer.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

NO_VERSION = -1
"""`TrainingSample.versions` entry of tokens the model did not generate in that sample."""


class TurnTokens(Protocol):
    """What a model turn must carry (`slipstream.envs.rollout.ModelTurn` has it)."""

    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    completion_versions: list[int] | None


@dataclass
class TrainingSample:
    """One packed sequence: entry t of every list describes token t."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    """True exactly on model-generated tokens."""
    logprobs: list[float] = field(default_factory=list)
    """Inference log-prob of model tokens; 0.0 elsewhere."""
    versions: list[int] = field(default_factory=list)
    """Policy version of model tokens; NO_VERSION elsewhere (and everywhere when turns carry no versions)."""
    turn_indices: list[int] = field(default_factory=list)
    """Indices of the rollout's model turns this sample holds."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int | None:
        """Oldest policy version among the model tokens (None when versions are unknown)."""
        known = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m and v != NO_VERSION]
        return min(known) if known else None

    def _append(self, token_ids: Sequence[int], model: bool, logprobs: Sequence[float], versions: Sequence[int]):
        self.token_ids.extend(token_ids)
        self.loss_mask.extend([model] * len(token_ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)


@dataclass
class SampleBuild:
    """Samples of one rollout and how many times the prefix broke (each break starts a new sample)."""

    samples: list[TrainingSample]
    num_prefix_breaks: int


def extension(previous_ids: Sequence[int], next_prompt_ids: Sequence[int]) -> list[int] | None:
    """The tokens `next_prompt_ids` adds after `previous_ids`, or None when it does not start with them exactly."""
    n = len(previous_ids)
    if len(next_prompt_ids) < n or list(next_prompt_ids[:n]) != list(previous_ids):
        return None
    return list(next_prompt_ids[n:])


def _checked(turn: TurnTokens, index: int) -> tuple[list[int], list[int], list[float], list[int]]:
    prompt, completion, logprobs = turn.prompt_token_ids, turn.completion_token_ids, turn.completion_logprobs
    if prompt is None or completion is None or logprobs is None:
        raise ValueError(f"model turn {index} carries no token ids or logprobs; token-in/token-out needs them")
    if len(logprobs) != len(completion):
        raise ValueError(f"model turn {index}: {len(completion)} completion tokens but {len(logprobs)} logprobs")
    versions = turn.completion_versions
    if versions is None:
        versions = [NO_VERSION] * len(completion)
    elif len(versions) != len(completion):
        raise ValueError(f"model turn {index}: {len(completion)} completion tokens but {len(versions)} versions")
    return list(prompt), list(completion), list(logprobs), list(versions)


def build_samples(turns: Sequence[TurnTokens]) -> SampleBuild:
    """Training samples of a rollout's model turns, in order (see the module docstring)."""
    samples: list[TrainingSample] = []
    num_breaks = 0
    for index, turn in enumerate(turns):
        prompt, completion, logprobs, versions = _checked(turn, index)
        added = extension(samples[-1].token_ids, prompt) if samples else None
        if added is None:
            if samples:
                num_breaks += 1
            samples.append(TrainingSample())
            added = prompt
        sample = samples[-1]
        sample._append(added, False, [0.0] * len(added), [NO_VERSION] * len(added))
        sample._append(completion, True, logprobs, versions)
        sample.turn_indices.append(index)
    return SampleBuild(samples=samples, num_prefix_breaks=num_breaks)
