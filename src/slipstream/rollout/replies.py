"""Whole (non-streamed) chat replies as rollouts: router replay's path, since vLLM 0.32 returns routed experts only
in whole replies. A whole reply cannot tell which weights produced each token, so every token is stamped with the
version served when the request was sent, the oldest it can be: staleness is judged early, never late.
"""

import math
from typing import TYPE_CHECKING

from slipstream.envs.base import Task
from slipstream.orchestrator.routing import decode_routed_experts
from slipstream.rollout.client import InferenceError
from slipstream.rollout.record import MISSING_LOGPROB, Rollout

if TYPE_CHECKING:
    import numpy as np


def parse_chat_response(
    reply: dict, task: Task, n: int, policy_version: int, require_routed_experts: bool = False
) -> list[Rollout]:
    """Turn a whole chat reply (`return_token_ids` + `logprobs`) into `n` rollouts; malformed replies raise.

    `policy_version` is the version served when the request was sent; every token is stamped with it (see the
    module docstring). `require_routed_experts` (router replay) makes a choice without `routed_experts` an error.
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
        message = choice.get("message") or {}
        routed = _routed_experts(choice, task, len(prompt_ids) + len(token_ids), require_routed_experts)
        rollouts.append(
            Rollout(
                task=task,
                prompt_token_ids=list(prompt_ids),
                completion_token_ids=list(token_ids),
                completion_logprobs=logprobs,
                completion_text=_text(message.get("content") if isinstance(message, dict) else None),
                token_versions=[policy_version] * len(token_ids),
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
