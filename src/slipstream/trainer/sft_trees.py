"""Prefix trees of SFT conversations (SFTConfig.shared_prefix): conversations of a micro-batch that begin with the
same tokens (system prompt, chat template) train as one tree, their shared tokens once (models/common/prefix_tree.py).
Only what transport/shared_prefix.py allows is shared (equal ids, no loss in any conversation), so loss and
gradients are those of the conversations one by one.

Which conversations share: ordered by the tokens they could share (those before their first loss token), the
conversations with long common prefixes sit side by side (the order of a walk through their trie), and a run of that
order may share the shortest prefix of its neighbouring pairs. The runs are chosen to save the most compute
(`TreeCost`; one pass of dynamic programming over the order), each sharing at least `min_prefix_tokens` tokens and
within the micro-batch budget; a run of one conversation is that conversation.
Deterministic: the same samples give the same trees and micro-batches (a resumed run stays exact).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from slipstream.trainer.sft_render import SFTSample
from slipstream.transport.shared_prefix import shared_prefix_len, tree_tokens


@dataclass(frozen=True)
class TreeCost:
    """Forward cost of a row of L tokens, per_token * L + per_pair * L^2 (row_layout.tree_row_costs): where every
    conversation may run as a padded row of its own, a tree's one row costs attention over all of its tokens."""

    per_token: int = 1
    per_pair: int = 0

    def of(self, num_tokens: int) -> int:
        return self.per_token * num_tokens + self.per_pair * num_tokens * num_tokens


@dataclass(frozen=True)
class PrefixSharing:
    """How to build trees: the shortest prefix worth sharing and the cost model that caps a tree's growth."""

    min_prefix_tokens: int
    cost: TreeCost = TreeCost()


@dataclass(frozen=True)
class SFTTree:
    """Conversations whose first `prefix_len` tokens are equal and carry no loss in any of them; the micro-batch holds
    the first conversation whole, then every other one's tokens after the prefix."""

    samples: tuple[SFTSample, ...]
    prefix_len: int

    @property
    def num_tokens(self) -> int:
        return tree_tokens(self.prefix_len, [s.num_tokens for s in self.samples])

    @property
    def num_loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.samples)

    def parts(self) -> list[tuple[SFTSample, int]]:
        """(conversation, its first token in the micro-batch): the prefix belongs to the first conversation."""
        return [(s, self.prefix_len if i else 0) for i, s in enumerate(self.samples)]


Unit = SFTSample | SFTTree
"""What packing places into a micro-batch: a conversation, or a tree of them."""


def unit_parts(unit: Unit) -> list[tuple[SFTSample, int]]:
    return [(unit, 0)] if isinstance(unit, SFTSample) else unit.parts()


def _head(sample: SFTSample) -> list[int]:
    """The tokens the conversation could share: those before its first loss token, all but its last token."""
    num_free = sample.loss_mask.index(True) if any(sample.loss_mask) else sample.num_tokens
    return sample.input_ids[: min(num_free, sample.num_tokens - 1)]


def _unit(samples: list[SFTSample]) -> Unit:
    if len(samples) == 1:
        return samples[0]
    prefix_len = shared_prefix_len([s.input_ids for s in samples], [s.loss_mask for s in samples])
    return SFTTree(tuple(samples), prefix_len)


def build_trees(samples: Sequence[SFTSample], max_tokens: int, sharing: PrefixSharing) -> list[Unit]:
    """`samples` as trees (this module's docstring) and conversations, in the order of their first conversation in
    `samples`; no tree holds more than `max_tokens` tokens."""
    order = sorted(range(len(samples)), key=lambda i: _head(samples[i]))
    ordered = [samples[i] for i in order]
    # pair_len[k]: what ordered[k] and ordered[k + 1] may share; a run of the order may share the least of its pairs.
    pair_len = [shared_prefix_len([a.input_ids, b.input_ids], [a.loss_mask, b.loss_mask]) for a, b in pairwise(ordered)]
    cost = sharing.cost
    # best[j]: the most that runs of ordered[:j] save; start[j]: where the last of those runs starts.
    best, start = [0] * (len(ordered) + 1), [0] * (len(ordered) + 1)
    for j in range(1, len(ordered) + 1):
        best[j], start[j] = best[j - 1], j - 1  # ordered[j - 1] alone
        prefix_len, num_tokens = max_tokens, ordered[j - 1].num_tokens
        alone = cost.of(num_tokens)
        for i in range(j - 2, -1, -1):  # the tree ordered[i:j]: its prefix shrinks and its tokens grow as i falls
            prefix_len = min(prefix_len, pair_len[i])
            num_tokens += ordered[i].num_tokens
            tree_tokens = num_tokens - prefix_len * (j - i - 1)
            if prefix_len < sharing.min_prefix_tokens or tree_tokens > max_tokens:
                break
            alone += cost.of(ordered[i].num_tokens)
            if best[i] + alone - cost.of(tree_tokens) > best[j]:
                best[j], start[j] = best[i] + alone - cost.of(tree_tokens), i
    units: list[tuple[int, Unit]] = []  # (index of its first conversation in `samples`, unit)
    j = len(ordered)
    while j:
        units.append((min(order[start[j] : j]), _unit(ordered[start[j] : j])))
        j = start[j]
    return [unit for _, unit in sorted(units, key=lambda u: u[0])]
