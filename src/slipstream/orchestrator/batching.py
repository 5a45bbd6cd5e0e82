"""Batching: rollouts -> token-aligned samples -> packed micro-batches -> one TrainingBatch per trainer rank.

Packing is first-fit decreasing under a token budget; micro-batches are spread over ranks balancing tokens,
with equal micro-batch counts per rank whenever the samples allow it (FSDP ranks step in lockstep).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slipstream.orchestrator.rollouts import Rollout
from slipstream.orchestrator.routing import align_routing, pack_routing
from slipstream.transport.rollouts import MicroBatch, TrainingBatch, write_batch


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
    )


def build_samples(rollout: Rollout, temperature: float) -> list[Sample]:
    """The samples of a rollout. Multi-turn: its token-exact samples, where only model tokens (loss_mask) carry the
    rollout's advantage, logprob and temperature, and environment tokens are masked."""
    if rollout.samples is None:
        return [build_sample(rollout, temperature)]
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
            )
        )
    return samples


def pack_samples(samples: Sequence[Sample], micro_batch_tokens: int) -> list[list[Sample]]:
    """First-fit decreasing into bins of at most `micro_batch_tokens`; a longer sample gets a bin of its own."""
    bins: list[list[Sample]] = []
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


def _tokens(group: Sequence[Sample]) -> int:
    return sum(s.num_tokens for s in group)


def _split_largest(bins: list[list[Sample]]) -> bool:
    """Split the largest multi-sample bin into two token-balanced halves; False when every bin holds one sample."""
    splittable = [i for i, b in enumerate(bins) if len(b) > 1]
    if not splittable:
        return False
    i = max(splittable, key=lambda j: _tokens(bins[j]))
    halves: list[list[Sample]] = [[], []]
    for sample in sorted(bins[i], key=lambda s: s.num_tokens, reverse=True):
        halves[0 if _tokens(halves[0]) <= _tokens(halves[1]) else 1].append(sample)
    bins[i : i + 1] = halves
    return True


def distribute(bins: list[list[Sample]], num_ranks: int) -> list[list[list[Sample]]]:
    """Assign micro-batches to ranks: every rank gets at least one, counts equal where possible, tokens balanced."""
    bins = [list(b) for b in bins]
    num_samples = sum(len(b) for b in bins)
    if num_samples < num_ranks:
        raise ValueError(
            f"{num_samples} samples cannot give each of {num_ranks} trainer ranks a micro-batch; "
            "raise orchestrator.batch_size to at least the number of trainer ranks"
        )
    target = -(-len(bins) // num_ranks) * num_ranks  # equal counts per rank
    while len(bins) < target and _split_largest(bins):
        pass
    per_rank = -(-len(bins) // num_ranks)
    ranks: list[list[list[Sample]]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for b in sorted(bins, key=_tokens, reverse=True):
        # Fill empty ranks first, then the lightest rank that still has room under the per-rank count.
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < per_rank]
        r = min(open_ranks, key=lambda k: (len(ranks[k]) > 0, loads[k]))
        ranks[r].append(b)
        loads[r] += _tokens(b)
    return ranks


def to_micro_batch(samples: Sequence[Sample]) -> MicroBatch:
    """Concatenate samples; positions restart at 0 for each sample."""
    input_ids, position_ids, loss_mask, advantages, logprobs, temperatures = [], [], [], [], [], []
    for s in samples:
        input_ids += s.input_ids
        position_ids += list(range(s.num_tokens))
        loss_mask += s.loss_mask
        advantages += s.advantages
        logprobs += s.inference_logprobs
        temperatures += s.temperatures
    routing = pack_routing([s.routed_experts for s in samples], [s.num_tokens for s in samples])
    return MicroBatch(input_ids, position_ids, loss_mask, advantages, logprobs, temperatures, routing)


def build_training_batches(
    step: int,
    rollouts: Sequence[Rollout],
    temperature: float,
    micro_batch_tokens: int,
    num_ranks: int,
    metrics: dict[str, float],
) -> list[TrainingBatch]:
    """One TrainingBatch per rank; `num_loss_tokens` counts the loss tokens of the whole step."""
    samples = [sample for r in rollouts for sample in build_samples(r, temperature)]
    if not samples:
        raise ValueError(
            f"step {step}: no tokens to train on; every rollout ended before its first model turn "
            "(does the task prompt exceed inference.max_model_len?)"
        )
    per_rank = distribute(pack_samples(samples, micro_batch_tokens), num_ranks)
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


def write_training_batches(output_dir: Path, batches: Sequence[TrainingBatch]) -> list[Path]:
    """Write every rank's batch atomically (the trainer polls for its own rank file)."""
    return [write_batch(output_dir, batch) for batch in batches]
