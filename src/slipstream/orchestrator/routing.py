"""Router replay on the orchestrator's side: vLLM's per-token routed experts (`enable_return_routed_experts`) decoded
from a reply, aligned with a sample's tokens and packed for the trainer (transport/rollouts.py: Routing).

vLLM returns, per choice, base64 `.npy` bytes of a [prompt + completion tokens - 1, moe_layers, top_k] integer
array: the last sampled token was never forwarded, so it has no routing. Rows the orchestrator has no routing for
(that token, and any token of a sample without routing) are filled with NO_ROUTE: the trainer routes them itself.
"""

import base64
import binascii
import io

import numpy as np

from slipstream.transport.rollouts import Routing


def routing_dtype(max_expert: int) -> np.dtype:
    """The compact dtype holding expert ids up to `max_expert` plus the NO_ROUTE marker."""
    return np.dtype(np.uint8) if max_expert < np.iinfo(np.uint8).max else np.dtype(np.uint16)


def no_route(dtype: np.dtype) -> int:
    """Marker of a token without routing: the dtype's largest value."""
    return int(np.iinfo(dtype).max)


def decode_routed_experts(encoded: str, where: str) -> np.ndarray:
    """vLLM's base64 `.npy` routed experts -> a [tokens, moe_layers, top_k] array in a compact unsigned dtype."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:  # EOFError: empty data
        raise ValueError(f"{where}: routed_experts is not base64 .npy data ({e})") from e
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{where}: routed_experts must be a 3-d integer array, got {array.dtype}{list(array.shape)}")
    if array.size and array.min() < 0:
        raise ValueError(f"{where}: routed_experts holds negative expert ids")
    top = int(array.max()) if array.size else 0
    if top >= np.iinfo(np.uint16).max:
        raise ValueError(f"{where}: routed_experts holds expert id {top}; at most 65534 experts are supported")
    return array.astype(routing_dtype(top))


def align_routing(routed: np.ndarray, num_tokens: int, where: str) -> np.ndarray:
    """[num_tokens, layers, top_k]: `routed`'s rows for the first tokens, NO_ROUTE for the rest."""
    if routed.shape[0] > num_tokens:
        raise ValueError(f"{where}: routed_experts has {routed.shape[0]} rows for a sample of {num_tokens} tokens")
    out = np.full((num_tokens, *routed.shape[1:]), no_route(routed.dtype), dtype=routed.dtype)
    out[: routed.shape[0]] = routed
    return out


def pack_routing(per_sample: list[np.ndarray | None], lengths: list[int]) -> Routing | None:
    """One micro-batch's Routing from its samples' aligned routing (None for a sample without any); None when no
    sample has routing."""
    known = [r for r in per_sample if r is not None]
    if not known:
        return None
    shapes = {r.shape[1:] for r in known}
    if len(shapes) != 1:
        raise ValueError(f"samples of one micro-batch have routing of different [layers, top_k] shapes: {shapes}")
    (num_layers, top_k), dtype = shapes.pop(), max((r.dtype for r in known), key=lambda d: d.itemsize)
    parts = [
        r.astype(dtype) if r is not None else np.full((n, num_layers, top_k), no_route(dtype), dtype=dtype)
        for r, n in zip(per_sample, lengths, strict=True)
    ]
    # A uint8 NO_ROUTE widened to uint16 must stay NO_ROUTE.
    for part, r in zip(parts, per_sample, strict=True):
        if r is not None and r.dtype != dtype:
            part[r == no_route(r.dtype)] = no_route(dtype)
    data = np.ascontiguousarray(np.concatenate(parts)).tobytes()
    return Routing(data=data, dtype=dtype.name, num_layers=num_layers, top_k=top_k)
