"""The shared-prefix rule of prefix trees (models/common/prefix_tree.py), for both sides that build them: the
orchestrator's RL batches (orchestrator/batching.py) and SFT's micro-batches (trainer/sft_trees.py). Pure numpy,
so neither side imports the other (nor torch) to use it.

A prefix may be shared by samples only where every sample has the same token id and none has loss there: a tree
holds the prefix once, so a loss token in it would be counted once instead of once per sample. At least one token
of each sample stays outside the prefix (a branch holds at least one token).
"""

from collections.abc import Sequence

import numpy as np


def shareable_tokens(input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]]) -> np.ndarray:
    """shareable_N (bool) over the first N = (fewest tokens of a sample) - 1 tokens: equal token id in every sample,
    and no loss in any. Empty when a sample has a single token."""
    n = min(len(ids) for ids in input_ids) - 1
    if n <= 0:
        return np.zeros(0, dtype=bool)
    ids_SN = np.array([ids[:n] for ids in input_ids])
    return (ids_SN == ids_SN[0]).all(0) & ~np.array([mask[:n] for mask in loss_masks], dtype=bool).any(0)


def leading_run(shareable_N: np.ndarray) -> int:
    """How many tokens of `shareable_N` are shareable before the first that is not."""
    return len(shareable_N) if shareable_N.all() else int(np.argmin(shareable_N))


def shared_prefix_len(input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]]) -> int:
    """Longest prefix the samples may share (this module's rule)."""
    return leading_run(shareable_tokens(input_ids, loss_masks))


def tree_tokens(prefix_len: int, sample_tokens: Sequence[int]) -> int:
    """Tokens of a prefix tree of samples of `sample_tokens` tokens sharing their first `prefix_len`: the prefix once,
    then every sample's remaining tokens."""
    return prefix_len + sum(n - prefix_len for n in sample_tokens)
