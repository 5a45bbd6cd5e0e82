"""Batching: rollouts -> token-aligned samples -> prefix trees -> packed micro-batches -> one TrainingBatch per rank.

Shared prefix (orchestrator.shared_prefix): the samples of one rollout group (single-turn rollouts, and the samples of
multi-turn rollouts) that begin with the same prompt become one prefix tree (models/common/prefix_tree.py): the
prompt once, then each sample's remaining tokens, whose positions continue the prompt's. Only tokens that carry no
loss in any sample are shared, so every loss token is trained exactly once, as one by one; the trainer computes
the same loss and gradients with the prompt's tokens computed once. A tree's shared tokens keep the first sample's
per-token values (no loss; router replay rows are shared only where every sample's rows are equal).

Packing is first-fit decreasing under a token budget (a tree counts its tokens: the prefix once); micro-batches are
spread over ranks balancing tokens, with equal micro-batch counts per rank whenever the samples allow it (FSDP ranks
step in lockstep); a tree is split in two where ranks need more micro-batches.

Vision-language rollouts: a sample keeps its prompt's images (the encoded files of its `image_url` data URLs) and
carries them into whichever micro-batch packing puts it in (MicroBatch.images). Samples with images are never
shared as prefix trees (the trainer runs them through transformers' vision-language model, one padded row each).
Inference already expanded each image's placeholder in the prompt tokens; samples are never truncated here. A
sample whose completion holds an image or video placeholder token (the model sampled one) is dropped and counted
(`batch/dropped_image_samples`): the trainer's forward would take it for an image without pixels.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slipstream.orchestrator.routing import align_routing, no_route, pack_routing
from slipstream.rollout.record import Rollout
from slipstream.transport.rollouts import MicroBatch, SampleImages, TrainingBatch, write_batch
from slipstream.transport.shared_prefix import leading_run, shareable_tokens, tree_tokens
from slipstream.utils.images import message_image_bytes


@dataclass(frozen=True)
class Sample:
    """One rollout as aligned token arrays (entry t describes token t)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    temperatures: list[float]
    routed_experts: np.ndarray | None = None
    """Router replay: [tokens, moe_layers, top_k], NO_ROUTE where inference did not route (routing.py)."""
    images: tuple[bytes, ...] = ()
    """Vision-language prompts: the prompt's image files, in placeholder order (empty: no image)."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def build_sample(rollout: Rollout, temperature: float) -> Sample:
    """A single-turn rollout's sample: prompt tokens carry no loss; completion tokens carry the rollout's advantage,
    logprob and temperature."""
    num_prompt, num_completion = len(rollout.prompt_token_ids), len(rollout.completion_token_ids)
    if len(rollout.completion_logprobs) != num_completion:
        raise ValueError(
            f"task {rollout.task.id}: {num_completion} completion tokens but {len(rollout.completion_logprobs)} logprobs"
        )
    return Sample(
        input_ids=rollout.prompt_token_ids + rollout.completion_token_ids,
        loss_mask=[False] * num_prompt + [True] * num_completion,
        advantages=[0.0] * num_prompt + [rollout.advantage] * num_completion,
        inference_logprobs=[0.0] * num_prompt + list(rollout.completion_logprobs),
        temperatures=[1.0] * num_prompt + [temperature] * num_completion,
        routed_experts=None
        if rollout.routed_experts is None
        else align_routing(rollout.routed_experts, num_prompt + num_completion, f"task {rollout.task.id}"),
        images=tuple(message_image_bytes(rollout.task.prompt)),
    )


def build_samples(rollout: Rollout, temperature: float) -> list[Sample]:
    """The samples of a rollout. Multi-turn: its token-exact samples, where only model tokens (loss_mask) carry the
    rollout's advantage, logprob and temperature, and environment tokens are masked."""
    if rollout.samples is None:
        return [build_sample(rollout, temperature)]
    # Every sample starts with the task's prompt (a sample after a prefix break is a whole re-rendered conversation),
    # so it holds the prompt's images; environments add none (envs/rollout.py refuses images in their messages).
    images = tuple(message_image_bytes(rollout.task.prompt))
    samples = []
    for s in rollout.samples:
        mask = list(s.loss_mask)
        if not len(s.token_ids) == len(mask) == len(s.logprobs):
            raise ValueError(f"task {rollout.task.id}: a multi-turn sample has token arrays of different lengths")
        samples.append(
            Sample(
                input_ids=list(s.token_ids),
                loss_mask=mask,
                advantages=[rollout.advantage if m else 0.0 for m in mask],
                inference_logprobs=[lp if m else 0.0 for lp, m in zip(s.logprobs, mask, strict=True)],
                temperatures=[temperature if m else 1.0 for m in mask],
                images=images,
            )
        )
    return samples


@dataclass(frozen=True)
class Tree:
    """Samples trained as one prefix tree: their first `prefix_len` tokens are equal and carry no loss in any of
    them; the micro-batch holds them once (the first sample's), then every sample's remaining tokens."""

    samples: list[Sample]
    prefix_len: int

    @property
    def num_tokens(self) -> int:
        return tree_tokens(self.prefix_len, [s.num_tokens for s in self.samples])

    @property
    def num_loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.samples)


Unit = Sample | Tree
"""What packing places: a sample, or a tree of samples."""


def _num_samples(unit: Unit) -> int:
    return len(unit.samples) if isinstance(unit, Tree) else 1


def _routing_rows(sample: Sample, n: int) -> np.ndarray | None:
    """The first n rows of a sample's routing as int64, -1 where not routed; None: no routing."""
    if sample.routed_experts is None:
        return None
    rows = sample.routed_experts[:n].astype(np.int64)
    rows[sample.routed_experts[:n] == no_route(sample.routed_experts.dtype)] = -1
    return rows


def shared_prefix_len(samples: Sequence[Sample]) -> int:
    """Longest prefix that all `samples` may share: transport/shared_prefix.py's rule (equal token ids, no loss token
    in any sample, at least one token of each sample left), and equal router replay rows (a sample without routing
    counts as not routed)."""
    shareable_N = shareable_tokens([s.input_ids for s in samples], [s.loss_mask for s in samples])
    n = len(shareable_N)
    if n and any(s.routed_experts is not None for s in samples):
        known = next(r for s in samples if (r := _routing_rows(s, n)) is not None)
        rows = [_routing_rows(s, n) for s in samples]
        rows_SNLK = np.stack([np.full_like(known, -1) if r is None else r for r in rows])
        shareable_N &= (rows_SNLK == rows_SNLK[0]).all(axis=(0, 2, 3))
    return leading_run(shareable_N)


def build_trees(groups: Sequence[Sequence[Sample]], micro_batch_tokens: int, min_prefix_tokens: int) -> list[Unit]:
    """Each group's samples that share a prefix of at least `min_prefix_tokens` (shared_prefix_len) as trees of at
    most `micro_batch_tokens` tokens (a group too large for one is split into several); the rest as samples."""
    units: list[Unit] = []
    for group in groups:
        buckets: dict[tuple[int, ...], list[Sample]] = defaultdict(list)
        for sample in group:
            head = sample.input_ids[:min_prefix_tokens]
            shareable = not sample.images and not any(sample.loss_mask[:min_prefix_tokens])
            if sample.num_tokens > min_prefix_tokens and shareable:
                buckets[tuple(head)].append(sample)
            else:
                units.append(sample)
        for bucket in buckets.values():
            prefix_len = shared_prefix_len(bucket) if len(bucket) > 1 else 0
            if prefix_len < min_prefix_tokens:
                units += bucket
                continue
            trees: list[list[Sample]] = [[]]
            for sample in sorted(bucket, key=lambda s: s.num_tokens, reverse=True):
                if trees[-1] and Tree([*trees[-1], sample], prefix_len).num_tokens > micro_batch_tokens:
                    trees.append([])
                trees[-1].append(sample)
            units += [Tree(t, prefix_len) if len(t) > 1 else t[0] for t in trees]
    return units


def pack_samples(samples: Sequence[Unit], micro_batch_tokens: int) -> list[list[Unit]]:
    """First-fit decreasing into bins of at most `micro_batch_tokens`; a longer sample (or tree) gets a bin of its
    own."""
    bins: list[list[Unit]] = []
    loads: list[int] = []
    for sample in sorted(samples, key=lambda s: s.num_tokens, reverse=True):
        for i, load in enumerate(loads):
            if load + sample.num_tokens <= micro_batch_tokens:
                bins[i].append(sample)
                loads[i] += sample.num_tokens
                break
        else:
            bins.append([sample])
            loads.append(sample.num_tokens)
    return bins


def _tokens(group: Sequence[Unit]) -> int:
    return sum(s.num_tokens for s in group)


def _split_tree(tree: Tree) -> list[list[Unit]]:
    """A tree as two token-balanced trees (a tree of one sample is that sample)."""
    halves: list[list[Sample]] = [[], []]
    for sample in sorted(tree.samples, key=lambda s: s.num_tokens, reverse=True):
        halves[0 if _tokens(halves[0]) <= _tokens(halves[1]) else 1].append(sample)
    return [[Tree(h, tree.prefix_len) if len(h) > 1 else h[0]] for h in halves]


def _split_largest(bins: list[list[Unit]]) -> bool:
    """Split the largest bin of several samples into two token-balanced halves (a bin holding one tree: the tree);
    False when every bin holds one sample."""
    splittable = [i for i, b in enumerate(bins) if sum(_num_samples(u) for u in b) > 1]
    if not splittable:
        return False
    i = max(splittable, key=lambda j: _tokens(bins[j]))
    if len(bins[i]) == 1:
        bins[i : i + 1] = _split_tree(bins[i][0])
        return True
    halves: list[list[Unit]] = [[], []]
    for sample in sorted(bins[i], key=lambda s: s.num_tokens, reverse=True):
        halves[0 if _tokens(halves[0]) <= _tokens(halves[1]) else 1].append(sample)
    bins[i : i + 1] = halves
    return True


def distribute(bins: list[list[Unit]], num_ranks: int) -> list[list[list[Unit]]]:
    """Assign micro-batches to ranks: every rank gets at least one, counts equal where possible, tokens balanced."""
    bins = [list(b) for b in bins]
    num_samples = sum(_num_samples(u) for b in bins for u in b)
    if num_samples < num_ranks:
        raise ValueError(
            f"{num_samples} samples cannot give each of {num_ranks} trainer ranks a micro-batch; "
            "raise orchestrator.batch_size to at least the number of trainer ranks"
        )
    target = -(-len(bins) // num_ranks) * num_ranks  # equal counts per rank
    while len(bins) < target and _split_largest(bins):
        pass
    per_rank = -(-len(bins) // num_ranks)
    ranks: list[list[list[Unit]]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for b in sorted(bins, key=_tokens, reverse=True):
        # Fill empty ranks first, then the lightest rank that still has room under the per-rank count.
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < per_rank]
        r = min(open_ranks, key=lambda k: (len(ranks[k]) > 0, loads[k]))
        ranks[r].append(b)
        loads[r] += _tokens(b)
    return ranks


def _parts(unit: Unit) -> list[tuple[Sample, int]]:
    """(sample, first token it contributes) of a unit: a tree's further samples start after the shared prefix."""
    if isinstance(unit, Sample):
        return [(unit, 0)]
    return [(s, unit.prefix_len if i else 0) for i, s in enumerate(unit.samples)]


def to_micro_batch(units: Sequence[Unit]) -> MicroBatch:
    """Concatenate samples and trees; positions restart at 0 for each sample and tree, and continue the shared
    prefix's positions in each further sample of a tree."""
    input_ids, position_ids, loss_mask, advantages, logprobs, temperatures = [], [], [], [], [], []
    routings, lengths, images = [], [], []
    for s, start in [part for unit in units for part in _parts(unit)]:
        if s.images:
            images.append(SampleImages(start=len(input_ids), num_tokens=s.num_tokens, images=list(s.images)))
        input_ids += s.input_ids[start:]
        position_ids += list(range(start, s.num_tokens))
        loss_mask += s.loss_mask[start:]
        advantages += s.advantages[start:]
        logprobs += s.inference_logprobs[start:]
        temperatures += s.temperatures[start:]
        routings.append(None if s.routed_experts is None else s.routed_experts[start:])
        lengths.append(s.num_tokens - start)
    routing = pack_routing(routings, lengths)
    return MicroBatch(
        input_ids, position_ids, loss_mask, advantages, logprobs, temperatures, routing, images=images or None
    )


def build_training_batches(
    step: int,
    rollouts: Sequence[Rollout],
    temperature: float,
    micro_batch_tokens: int,
    num_ranks: int,
    metrics: dict[str, float],
    shared_prefix: bool = True,
    shared_prefix_min_tokens: int = 2,
    placeholder_ids: frozenset[int] = frozenset(),
) -> list[TrainingBatch]:
    """One TrainingBatch per rank; `num_loss_tokens` counts the loss tokens of the whole step. With `shared_prefix`
    the samples of each group (`Rollout.group_index`) that share a prompt of at least `shared_prefix_min_tokens`
    tokens are packed as prefix trees (build_trees). `placeholder_ids` (vision-language models: the image and video
    placeholder tokens): samples that sampled one are dropped (drop_sampled_placeholders)."""
    groups: dict[int, list[Sample]] = defaultdict(list)
    for r in rollouts:
        groups[r.group_index] += build_samples(r, temperature)
    if placeholder_ids:
        metrics["batch/dropped_image_samples"] = float(drop_sampled_placeholders(groups, placeholder_ids))
        groups = {g: samples for g, samples in groups.items() if samples}
    samples = [sample for group in groups.values() for sample in group]
    if not samples:
        raise ValueError(
            f"step {step}: no tokens to train on; every rollout ended before its first model turn "
            "(does the task prompt exceed inference.max_model_len?)"
        )
    units: Sequence[Unit] = samples
    if shared_prefix:
        units = build_trees(list(groups.values()), micro_batch_tokens, shared_prefix_min_tokens)
    per_rank = distribute(pack_samples(units, micro_batch_tokens), num_ranks)
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)
    return [
        TrainingBatch(
            step=step,
            rank=rank,
            num_loss_tokens=num_loss_tokens,
            micro_batches=[to_micro_batch(b) for b in bins],
            metrics=dict(metrics),
        )
        for rank, bins in enumerate(per_rank)
    ]


def drop_sampled_placeholders(groups: dict[int, list[Sample]], placeholder_ids: frozenset[int]) -> int:
    """Remove (in place) the samples whose loss tokens hold one of `placeholder_ids`; return how many. vLLM embeds a
    sampled placeholder as text, but the trainer's vision-language forward would count it as an image's token and
    find no pixels for it, so such a sample cannot be trained as it was generated."""
    num_dropped = 0
    for group in groups.values():
        kept = [
            s
            for s in group
            if not any(m and t in placeholder_ids for t, m in zip(s.input_ids, s.loss_mask, strict=True))
        ]
        num_dropped += len(group) - len(kept)
        group[:] = kept
    return num_dropped


def write_training_batches(output_dir: Path, batches: Sequence[TrainingBatch]) -> list[Path]:
    """Write every rank's batch atomically (the trainer polls for its own rank file)."""
    return [write_batch(output_dir, batch) for batch in batches]
