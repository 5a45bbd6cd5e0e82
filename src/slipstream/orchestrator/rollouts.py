"""Rollouts: one sampled completion (or one multi-turn conversation) with its token ids, log-probs and the policy
version of every token, and the parsing of whole (non-streamed) chat replies. Token ids and log-probs are taken
verbatim from the server.

Completion text is used only for rewards; training tokens are never re-tokenized.
"""

import asyncio
import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slipstream.config.orchestrator import SamplingConfig
from slipstream.envs.base import Task
from slipstream.envs.tokens import TrainingSample
from slipstream.orchestrator.client import InferenceError
from slipstream.orchestrator.routing import decode_routed_experts

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


class WeightedSemaphore:
    """Bounds the number of completions in flight; a request for `n` completions takes `n` units."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = capacity
        self._cond = asyncio.Condition()

    async def acquire(self, units: int) -> int:
        # A group larger than the capacity runs alone instead of waiting forever.
        units = min(units, self.capacity)
        async with self._cond:
            await self._cond.wait_for(lambda: self._free >= units)
            self._free -= units
        return units

    async def release(self, units: int) -> None:
        async with self._cond:
            self._free += units
            self._cond.notify_all()


def sampling_params(sampling: SamplingConfig) -> dict[str, Any]:
    """Chat-completion sampling fields (vLLM prefers `max_completion_tokens` over the deprecated `max_tokens`)."""
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_completion_tokens": sampling.max_tokens}


def request_seed(seed: int, task_index: int) -> int:
    """Base sampling seed of a rollout group's requests: a hash of the run's seed and the task's stream position."""
    digest = hashlib.blake2b(f"rollout:{seed}:{task_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 31)  # leaves room for the per-sample and per-turn offsets


def cache_salt(policy_version: int) -> str:
    """Prefix-cache salt of a policy version, so cached KV never crosses versions."""
    return f"policy-{policy_version}"


def parse_chat_response(
    reply: dict,
    task: Task,
    n: int,
    policy_version: int,
    require_token_versions: bool = False,
    require_routed_experts: bool = False,
) -> list[Rollout]:
    """Turn a whole chat reply (`return_token_ids` + `logprobs`) into `n` rollouts; malformed replies raise.

    `policy_version` is the version served when the request was sent. Choices that carry `token_versions` (the
    simulated server) keep them; otherwise every token is attributed to `policy_version`, which is exact only when
    no weight update can land during the request (evaluation of a fixed policy). `require_token_versions` makes
    their absence an error (the rollout pipeline, which updates weights mid-request). `require_routed_experts`
    (router replay) makes a choice without `routed_experts` an error.
    """
    if not isinstance(reply, dict):
        raise InferenceError(f"task {task.id}: chat reply is not a JSON object: {reply!r:.300}")
    prompt_ids = reply.get("prompt_token_ids")
    choices = reply.get("choices") or []
    if not prompt_ids:
        raise InferenceError(
            f"task {task.id}: chat reply lacks prompt_token_ids; the request must set return_token_ids"
        )
    if not _is_token_ids(prompt_ids):
        raise InferenceError(f"task {task.id}: chat reply's prompt_token_ids are not token ids: {prompt_ids!r:.300}")
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else repr(choices)[:100]
        raise InferenceError(f"task {task.id}: asked for {n} completions, got {got}")
    if not all(isinstance(c, dict) and _is_int(c.get("index")) for c in choices):
        raise InferenceError(f"task {task.id}: chat reply has a choice without an integer index: {choices!r:.300}")
    rollouts = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        token_ids = choice.get("token_ids")
        logprobs_field = choice.get("logprobs")
        content = logprobs_field.get("content") if isinstance(logprobs_field, dict) else None
        if token_ids is None or content is None:
            raise InferenceError(
                f"task {task.id}: choice {choice['index']} lacks token_ids or logprobs.content "
                "(a reasoning parser with include_reasoning=false hides token ids; keep include_reasoning on)"
            )
        if not _is_token_ids(token_ids) or not isinstance(content, list):
            raise InferenceError(
                f"task {task.id}: choice {choice['index']} has token_ids or logprobs.content that are not lists of "
                f"token ids and log-prob entries: {choice!r:.300}"
            )
        if len(token_ids) != len(content):
            raise InferenceError(
                f"task {task.id}: choice {choice['index']} has {len(token_ids)} token ids but {len(content)} logprobs"
            )
        logprobs = [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
        if not all(isinstance(lp, int | float) and not isinstance(lp, bool) and math.isfinite(lp) for lp in logprobs):
            raise InferenceError(
                f"task {task.id}: choice {choice['index']} has logprobs.content entries without a finite 'logprob'"
            )
        logprobs = [float(lp) for lp in logprobs]
        if any(lp <= MISSING_LOGPROB for lp in logprobs):
            raise InferenceError(f"task {task.id}: choice {choice['index']} has tokens without a log-prob from vLLM")
        versions = _token_versions(choice, task, len(token_ids), policy_version, require_token_versions)
        message = choice.get("message") or {}
        routed = _routed_experts(choice, task, len(prompt_ids) + len(token_ids), require_routed_experts)
        rollouts.append(
            Rollout(
                task=task,
                prompt_token_ids=list(prompt_ids),
                completion_token_ids=list(token_ids),
                completion_logprobs=logprobs,
                completion_text=_text(message.get("content") if isinstance(message, dict) else None),
                token_versions=versions,
                request_version=policy_version,
                finish_reason=_text(choice.get("finish_reason")) or None,
                routed_experts=routed,
            )
        )
    return rollouts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(_is_int(t) and 0 <= t < 2**63 for t in value)


def _text(value: object) -> str:
    """A reply's text field: "" when absent (None); anything but a string is not text."""
    if value is not None and not isinstance(value, str):
        raise InferenceError(f"chat reply has {value!r:.100} where a string or null belongs")
    return value or ""


def _routed_experts(choice: dict, task: Task, num_tokens: int, required: bool) -> "np.ndarray | None":
    encoded = choice.get("routed_experts")
    where = f"task {task.id}: choice {choice['index']}"
    if encoded is not None and not isinstance(encoded, str):
        raise InferenceError(f"{where}: routed_experts is not base64 text: {encoded!r:.100}")
    if encoded is None:
        if required:
            raise InferenceError(
                f"{where} has no routed_experts; orchestrator.router_replay needs inference started with "
                "inference.enable_return_routed_experts = true (vLLM's GPU build) or a simulator with routed_experts"
            )
        return None
    try:
        routed = decode_routed_experts(encoded, where)
    except ValueError as e:
        raise InferenceError(str(e)) from e
    if routed.shape[0] > num_tokens:
        raise InferenceError(f"{where}: routed_experts has {routed.shape[0]} rows for {num_tokens} tokens")
    return routed


def _token_versions(choice: dict, task: Task, num_tokens: int, policy_version: int, required: bool) -> list[int]:
    versions = choice.get("token_versions")
    if versions is None:
        if required:
            raise InferenceError(
                f"task {task.id}: choice {choice['index']} has no token_versions; orchestrator.version_tracking "
                "= 'reply' needs a server that reports them (the simulated server); use 'stream' with vLLM"
            )
        return [policy_version] * num_tokens
    if not isinstance(versions, list) or not all(_is_int(v) for v in versions):
        raise InferenceError(f"task {task.id}: choice {choice['index']} has token_versions that are not integers")
    if len(versions) != num_tokens or any(v < policy_version for v in versions):
        raise InferenceError(
            f"task {task.id}: choice {choice['index']} has token_versions {versions} for {num_tokens} tokens of a "
            f"request sent at policy version {policy_version}"
        )
    return [int(v) for v in versions]
