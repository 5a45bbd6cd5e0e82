"""Assembly of a streamed chat completion (vLLM's chunk format) into rollouts, stamping each completion token
with the policy version served when the token arrived.

vLLM does not say which weights produced a token, so the stamp is an approximation, exact in practice: the weight
relay switches the stamped version after /pause (keep) returned and the new weights loaded, just before /resume.
vLLM freezes decode while paused and flushes the outputs it already produced before /pause returns
(AsyncLLM.pause_generation), so tokens arriving during the pause window are old-version tokens, and tokens decoded
after /resume arrive after the switch. A token is misattributed only if its delivery takes longer than the whole
pause window (pause + load + cache reset), or if vLLM gathers several tokens a chunk (`inference.stream_interval`):
tokens still gathered when the pause comes arrive after it, at most `stream_interval - 1` per completion and update.
The KV cache of a request's earlier tokens stays the old policy's; its later tokens are still stamped with the new
version (the in-flight-update approximation every async RL system makes).

No-stall updates (`weights.no_stall`) have no pause: vLLM generates with the old version while the new one is staged,
and the relay switches the stamped version when /finish_weight_update (the swap, run between two engine steps)
returns. Tokens of the last engine step(s) before the swap whose chunks reach the orchestrator only after that reply
are stamped with the new version though the old one produced them: the steps whose outputs were still on their way
(vLLM's output path runs beside the engine loop), plus `stream_interval - 1` tokens gathered per completion. The other
way round, tokens of the first steps after the swap that reach the orchestrator before the reply (which also waits for
vLLM to record the weight version, one more engine-core round trip) are stamped with the old version. So the stamp may
be off by a few tokens per completion and update, either way; without a pause there is no window that separates them.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slipstream.envs.base import Message, Task
from slipstream.envs.rollout import ModelTurn
from slipstream.rollout.client import InferenceError
from slipstream.rollout.record import MISSING_LOGPROB, Rollout


@dataclass
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Tool calls assembled from their streamed deltas, by the call's index."""
    finish_reason: str | None = None

    def add_tool_call_deltas(self, deltas: list[dict[str, Any]], where: str) -> None:
        """Merge vLLM's streamed tool-call deltas: the first delta of a call brings its id, type and name, the
        following ones fragments of its JSON arguments."""
        for delta in deltas:
            index = delta.get("index")
            if not isinstance(index, int):
                raise InferenceError(f"{where}: streamed tool-call delta without an index: {delta!r:.300}")
            call = self.tool_calls.setdefault(index, {"id": None, "type": "function", "name": "", "arguments": ""})
            if delta.get("id"):
                call["id"] = delta["id"]
            if delta.get("type"):
                call["type"] = delta["type"]
            function = delta.get("function") or {}
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""

    def message(self) -> Message:
        """The assistant message as a non-streamed reply would carry it: content, tool_calls, reasoning."""
        message: Message = {"role": "assistant", "content": "".join(self.text)}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": c["type"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.tool_calls.items())
            ]
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        return message


class StreamedChat:
    """Accumulates the chunks of one streamed chat completion with `n` choices.

    `version_now()` is read once per chunk, when it arrives. `oldest_version` is the version of the oldest token
    received so far (None before the first token: tokens yet to come carry at least the version served then).
    """

    def __init__(self, n: int, version_now: Callable[[], int], where: str) -> None:
        self.n = n
        self.version_now = version_now
        self.where = where
        self.choices = [_Choice() for _ in range(n)]
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict | None = None
        self.oldest_version: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def add(self, chunk: dict) -> None:
        """Take one decoded `data:` chunk (role chunk, token chunk or final usage chunk)."""
        version = self.version_now()
        prompt_ids = chunk.get("prompt_token_ids")
        if prompt_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = list(prompt_ids)
        choices = chunk.get("choices") or []
        if not choices and chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in choices:
            self._add_choice(choice, version)

    def _add_choice(self, choice: dict, version: int) -> None:
        index = choice.get("index")
        if not isinstance(index, int) or not 0 <= index < self.n:
            raise InferenceError(f"{self.where}: chunk for choice {index!r} of a request for {self.n} choices")
        acc = self.choices[index]
        if acc.finish_reason is not None:
            raise InferenceError(f"{self.where}: chunk for choice {index} after its finish_reason")
        token_ids = choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if token_ids is None and content:
            raise InferenceError(
                f"{self.where}: choice {index} streams logprobs without token_ids (a reasoning parser with "
                "include_reasoning=false hides token ids; keep include_reasoning on)"
            )
        token_ids, content = token_ids or [], content or []
        if len(token_ids) != len(content):
            raise InferenceError(
                f"{self.where}: choice {index} streamed {len(token_ids)} token ids with {len(content)} logprobs"
            )
        logprobs = [float(entry["logprob"]) for entry in content]
        if any(lp <= MISSING_LOGPROB for lp in logprobs):
            raise InferenceError(f"{self.where}: choice {index} has tokens without a log-prob from vLLM")
        if token_ids:
            acc.token_ids += token_ids
            acc.logprobs += logprobs
            acc.versions += [version] * len(token_ids)
            self.oldest_version = version if self.oldest_version is None else min(self.oldest_version, version)
        delta = choice.get("delta") or {}
        if delta.get("content"):
            acc.text.append(delta["content"])
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            acc.reasoning.append(reasoning)
        if delta.get("tool_calls"):
            acc.add_tool_call_deltas(delta["tool_calls"], f"{self.where}: choice {index}")
        if choice.get("finish_reason") is not None:
            acc.finish_reason = choice["finish_reason"]

    def check_complete(self, task_id: str) -> list[int]:
        """Check the finished stream against the final usage chunk; return the prompt's token ids."""
        if self.prompt_token_ids is None:
            raise InferenceError(
                f"task {task_id}: {self.where} streamed no prompt_token_ids; the request must set return_token_ids"
            )
        unfinished = [i for i, c in enumerate(self.choices) if c.finish_reason is None]
        if unfinished:
            raise InferenceError(f"task {task_id}: {self.where}: stream ended before choices {unfinished} finished")
        if self.usage is None:
            raise InferenceError(
                f"task {task_id}: {self.where}: no final usage chunk; the request must set stream_options.include_usage"
            )
        if self.usage.get("completion_tokens") != self.num_tokens:
            raise InferenceError(
                f"task {task_id}: {self.where}: streamed {self.num_tokens} token ids but usage counts "
                f"{self.usage.get('completion_tokens')} completion tokens (a reasoning parser with "
                "include_reasoning=false hides token ids; keep include_reasoning on)"
            )
        return list(self.prompt_token_ids)

    def model_turn(self, task_id: str) -> ModelTurn:
        """The finished stream of a one-choice request as one model turn of a multi-turn rollout."""
        if self.n != 1:
            raise ValueError(f"a model turn is one completion; this stream has {self.n} choices")
        prompt_ids = self.check_complete(task_id)
        c = self.choices[0]
        return ModelTurn(
            message=c.message(),
            prompt_token_ids=prompt_ids,
            completion_token_ids=list(c.token_ids),
            completion_logprobs=list(c.logprobs),
            completion_versions=list(c.versions),
            finish_reason=c.finish_reason,
        )

    def rollouts(self, task: Task, request_version: int) -> list[Rollout]:
        """The finished stream as `n` rollouts; checks completeness against the final usage chunk."""
        self.check_complete(task.id)
        return [
            Rollout(
                task=task,
                prompt_token_ids=list(self.prompt_token_ids),
                completion_token_ids=c.token_ids,
                completion_logprobs=c.logprobs,
                completion_text="".join(c.text),
                token_versions=c.versions,
                request_version=request_version,
                finish_reason=c.finish_reason,
            )
            for c in self.choices
        ]
