"""The simulator's fake "model": byte tokenizer, deterministic sampled tokens, log-probs that change with the version.

A fake trainer can publish matching weight-check probes with `sim_logprob(step, token)`.
"""

import hashlib
import json
import random
from typing import Any


def sim_logprob(version: int, token_id: int) -> float:
    """Log-prob the simulated policy of `version` gives `token_id` (any context), in [-5.01, -0.01]."""
    digest = hashlib.blake2b(f"{version}:{token_id}".encode(), digest_size=8).digest()
    return -(int.from_bytes(digest, "little") % 1000) / 200.0 - 0.01


def token_text(token_id: int) -> str:
    """Detokenized text of a sampled token: one lowercase letter."""
    return chr(ord("a") + token_id % 26)


def tokenize_text(text: str) -> list[int]:
    """Prompt text -> token ids: its UTF-8 bytes."""
    return list(text.encode())


def tokenize_messages(messages: Any) -> list[int]:
    """Chat messages -> prompt token ids (a byte rendering of `role: content` lines); ValueError if malformed."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an object with a 'role' and a string 'content' (got {message!r})")
        lines.append(f"{message['role']}: {message['content']}\n")
    return tokenize_text("".join(lines) + "assistant: ")


def request_seed(server_seed: int, request_seed: int | None, prompt_ids: list[int]) -> str:
    """Seed material of a request's samples: the same server seed, request seed and prompt give the same tokens."""
    digest = hashlib.blake2b(json.dumps([server_seed, request_seed, prompt_ids]).encode(), digest_size=16)
    return digest.hexdigest()


def plan_completion(seed: str, index: int, max_tokens: int, vocab_size: int, stop_prob: float) -> tuple[list[int], str]:
    """Token ids of choice `index` and its finish reason: "stop" if it ended early, else "length"."""
    rng = random.Random(f"{seed}:{index}")
    token_ids = []
    for _ in range(max_tokens):
        token_ids.append(rng.randrange(vocab_size))
        if rng.random() < stop_prob:
            return token_ids, "stop"
    return token_ids, "length"


def sim_routing(token_ids: list[int], num_layers: int, top_k: int, num_experts: int, seed: int = 0):
    """The simulator's routed experts of a sequence, as vLLM returns them: [len(token_ids) - 1, num_layers, top_k]
    (the last token is never forwarded), top_k distinct experts per token and layer, a function of the sequence."""
    import numpy as np

    if top_k > num_experts:
        raise ValueError(f"routed_experts_top_k ({top_k}) exceeds routed_experts_num_experts ({num_experts})")
    digest = hashlib.blake2b(json.dumps([seed, token_ids]).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    scores = rng.random((max(len(token_ids) - 1, 0), num_layers, num_experts))
    return np.argsort(scores, axis=-1)[..., :top_k].astype(np.uint8 if num_experts < 255 else np.uint16)
