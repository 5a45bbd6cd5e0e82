"""The token record of a rollout: one sampled completion, or one multi-turn conversation, with its token ids,
log-probs and the policy version of every token, as the trainer gets it. Token ids and log-probs are taken verbatim
from the server; completion text is used only for rewards, training tokens are never re-tokenized.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slipstream.config.orchestrator import SamplingConfig
from slipstream.envs.base import Task
from slipstream.envs.multiturn import last_assistant_text
from slipstream.envs.rollout import RolloutResult
from slipstream.envs.tokens import TrainingSample, build_samples

if TYPE_CHECKING:
    import numpy as np

MISSING_LOGPROB = -9999.0
"""vLLM's placeholder when it has no log-prob for a token (and its clamp of -inf)."""


@dataclass
class Rollout:
    """One sampled completion of a task, or one multi-turn rollout, with what the trainer needs.

    Multi-turn: the completion fields hold every model-generated token, turn after turn, and `samples` the
    token-exact training sequences (environment tokens masked; see slipstream.envs.tokens).
    """

    task: Task
    prompt_token_ids: list[int]
    """Token ids of the (first turn's) prompt."""
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    """Inference log-prob of each completion token, at the sampling temperature."""
    completion_text: str
    token_versions: list[int]
    """Policy version that produced each completion token (non-decreasing)."""
    request_version: int
    """Policy version served when the (first) request was sent: no token is older."""
    finish_reason: str | None = None
    reward: float = 0.0
    advantage: float = 0.0
    group_index: int = 0
    """Dispatch index of the rollout's group: advantages are computed within a group."""
    samples: list[TrainingSample] | None = None
    """Multi-turn: the training samples (one per prefix break + 1). None: one sample, prompt + completion."""
    num_turns: int = 1
    """Model turns of the rollout."""
    num_prefix_breaks: int = 0
    """Turns whose prompt did not extend the previous turn's tokens (each starts a new sample)."""
    stop_reason: str | None = None
    """Multi-turn: why the rollout ended ("env_done", "max_turns", "context_length", ...)."""
    reward_metrics: dict[str, float] = field(default_factory=dict)
    """Named metrics the environment logged with the reward (multi-turn environments)."""
    routed_experts: "np.ndarray | None" = None
    """Router replay (single-turn): inference's experts per token of prompt + completion, [rows, moe_layers,
    top_k] (vLLM gives one row fewer than tokens: the last token was never forwarded); see routing.py."""

    @property
    def num_tokens(self) -> int:
        """Tokens the rollout trains on: its samples' tokens (prompt + completion for a single turn)."""
        if self.samples is not None:
            return sum(len(s.token_ids) for s in self.samples)
        return len(self.prompt_token_ids) + len(self.completion_token_ids)

    @property
    def oldest_version(self) -> int:
        """Version of the oldest token (the request's version for an empty completion)."""
        return min(self.token_versions, default=self.request_version)

    @property
    def newest_version(self) -> int:
        return max(self.token_versions, default=self.request_version)


def sampling_params(sampling: SamplingConfig) -> dict[str, Any]:
    """Chat-completion sampling fields (vLLM prefers `max_completion_tokens` over the deprecated `max_tokens`)."""
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_completion_tokens": sampling.max_tokens}


def cache_salt(policy_version: int) -> str:
    """Prefix-cache salt of a policy version, so cached KV never crosses versions."""
    return f"policy-{policy_version}"


def rollout_from_result(result: RolloutResult, group_index: int, request_version: int) -> Rollout:
    """A finished multi-turn rollout as a training rollout: its token-exact samples and its reward."""
    turns = result.turns
    build = build_samples(turns)
    return Rollout(
        task=result.task,
        prompt_token_ids=list(turns[0].prompt_token_ids or []) if turns else [],
        completion_token_ids=[t for turn in turns for t in turn.completion_token_ids or []],
        completion_logprobs=[lp for turn in turns for lp in turn.completion_logprobs or []],
        completion_text=last_assistant_text(result.messages),
        token_versions=[v for turn in turns for v in turn.completion_versions or []],
        request_version=request_version,
        finish_reason=turns[-1].finish_reason if turns else None,
        reward=result.reward.value,
        group_index=group_index,
        samples=build.samples,
        num_turns=len(turns),
        num_prefix_breaks=build.num_prefix_breaks,
        stop_reason=result.stop_reason,
        reward_metrics=dict(result.reward.metrics),
    )
