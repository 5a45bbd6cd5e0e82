"""Streamed chat completions of the simulator, in vLLM's server-sent-event chunks: a role chunk with the prompt's
token ids, one chunk per decoded token (delta text, `token_ids`, `logprobs.content`; the last one carries the
finish_reason), a usage chunk when `stream_options.include_usage`, then `data: [DONE]`.

Tokens are sent as the engine emits them, so a client sees each token when it is decoded, weight updates included,
exactly as it would from vLLM. Closing the connection aborts the request (vLLM aborts a disconnected request).
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from slipstream_sim.engine import Sequence, SimClosedError, SimEngine
from slipstream_sim.policy import token_text


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _token_choice(index: int, seq: Sequence, position: int, body: dict[str, Any]) -> dict[str, Any]:
    """The chunk choice of token `position` of `seq`."""
    token_id, text = seq.token_ids[position], token_text(seq.token_ids[position])
    choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    if body.get("logprobs"):
        entry = {"token": text, "logprob": seq.logprobs[position], "bytes": list(text.encode()), "top_logprobs": []}
        choice["logprobs"] = {"content": [entry]}
    if body.get("return_token_ids"):
        choice["token_ids"] = [token_id]
    return choice


class ChatStream:
    """The chunks of one streamed chat request whose sequences `seqs` the engine decodes."""

    def __init__(
        self, engine: SimEngine, body: dict[str, Any], envelope: dict[str, Any], prompt_ids: list[int]
    ) -> None:
        self.engine, self.body, self.envelope, self.prompt_ids = engine, body, envelope, prompt_ids

    def _chunk(self, choices: list[dict[str, Any]], **fields: Any) -> str:
        return _sse(
            {
                **self.envelope,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "choices": choices,
                **fields,
            }
        )

    def _new_choices(self, seqs: list[Sequence], sent: list[int], finished: list[bool]) -> list[str]:
        """Chunks of the tokens decoded since the last call, and of the finish of ended sequences."""
        chunks = []
        for index, seq in enumerate(seqs):
            if seq.progress is not None:
                seq.progress.clear()
            end = len(seq.token_ids)
            for position in range(sent[index], end):
                choice = _token_choice(index, seq, position, self.body)
                if position == end - 1 and seq.finish_reason is not None:
                    choice["finish_reason"], finished[index] = seq.finish_reason, True
                chunks.append(self._chunk([choice]))
            sent[index] = end
            if seq.finish_reason is not None and not finished[index]:
                finished[index] = True
                chunks.append(self._chunk([{"index": index, "delta": {}, "finish_reason": seq.finish_reason}]))
        return chunks

    async def chunks(self, seqs: list[Sequence]) -> AsyncIterator[str]:
        """Decode `seqs` and yield their chunks as tokens come; cancelling (a disconnect) aborts the request."""
        first: dict[str, Any] = {}
        if self.body.get("return_token_ids"):
            first["prompt_token_ids"] = self.prompt_ids
        roles = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(len(seqs))
        ]
        yield self._chunk(roles, **first)
        decode = asyncio.ensure_future(self.engine.decode(seqs, len(self.prompt_ids)))
        sent, finished = [0] * len(seqs), [False] * len(seqs)
        try:
            while True:
                for chunk in self._new_choices(seqs, sent, finished):
                    yield chunk
                if decode.done():
                    break
                waits = [asyncio.ensure_future(s.progress.wait()) for s in seqs if s.progress is not None]
                await asyncio.wait([decode, *waits], return_when=asyncio.FIRST_COMPLETED)
                for wait in waits:
                    wait.cancel()
            decode.result()
        except SimClosedError as e:
            yield _sse({"error": {"message": str(e), "type": "ServiceUnavailableError", "code": 503}})
            return
        finally:
            if not decode.done():
                for seq in seqs:
                    seq.aborted = True
                decode.cancel()
        for chunk in self._new_choices(seqs, sent, finished):
            yield chunk
        if (self.body.get("stream_options") or {}).get("include_usage"):
            completion_tokens = sum(len(seq.token_ids) for seq in seqs)
            usage = {
                "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(self.prompt_ids) + completion_tokens,
            }
            yield self._chunk([], usage=usage)
        yield "data: [DONE]\n\n"
