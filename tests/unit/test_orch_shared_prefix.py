"""Shared-prefix batching (orchestrator.shared_prefix): the samples of a group that share a prompt become prefix
trees; every sample can be read back token for token (with its router replay rows), budgets hold, and
shared_prefix=false gives the batches of plain packing."""

import random

import numpy as np
import pytest
import torch

from slipstream.envs.base import Task
from slipstream.envs.tokens import TrainingSample
from slipstream.orchestrator.batching import (
    Tree,
    build_sample,
    build_samples,
    build_training_batches,
    distribute,
    pack_samples,
    shared_prefix_len,
    to_micro_batch,
)
from slipstream.rollout.record import Rollout
from slipstream.trainer.data import build_padded_layout, expand_trees, routing_tensor, to_packed

TASK = Task(id="t", prompt=[])
CPU = torch.device("cpu")


def make_group(group: int, size: int, prompt_len: int, rng: random.Random, routing: bool = False) -> list[Rollout]:
    """A GRPO group: one prompt, `size` completions of random lengths; token ids are unique per completion token."""
    prompt = [group * 1000 + i for i in range(prompt_len)]
    rollouts = []
    for k in range(size):
        n = rng.randint(1, 30)
        completion = [10**6 + group * 10**4 + k * 100 + i for i in range(n)]
        routed = None
        if routing:  # the prompt's rows are equal across the group (one prefill); vLLM omits the last token's
            routed = np.array(
                [[[(t * 7 + j) % 8, (t * 3 + j + 1) % 8] for j in range(2)] for t in prompt]
                + [[[(t + j) % 8, (t + j + 3) % 8] for j in range(2)] for t in completion[:-1]],
                dtype=np.uint8,
            )
        rollouts.append(
            Rollout(
                task=TASK,
                prompt_token_ids=list(prompt),
                completion_token_ids=completion,
                completion_logprobs=[-0.001 * (t % 997) - 0.5 for t in completion],
                completion_text="",
                token_versions=[0] * n,
                request_version=0,
                advantage=rng.uniform(-1, 1),
                group_index=group,
                routed_experts=routed,
            )
        )
    return rollouts


def read_back(mb) -> list[tuple]:
    """The samples of a micro-batch (trees written out), each as aligned tuples of its per-token values."""
    source_E, _ = expand_trees(torch.tensor(mb.position_ids))
    starts = [e for e, s in enumerate(source_E.tolist()) if mb.position_ids[s] == 0] + [len(source_E)]
    routing = None if mb.routing is None else routing_tensor(mb.routing, len(mb.input_ids), CPU)
    samples = []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        idx = source_E[a:b].tolist()
        assert [mb.position_ids[i] for i in idx[1:]] == list(range(1, len(idx)))  # positions inside the sample
        values = [mb.input_ids, mb.loss_mask, mb.advantages, mb.inference_logprobs, mb.temperatures]
        sample = tuple(tuple(v[i] for i in idx) for v in values)
        if routing is not None:
            sample += (tuple(routing[idx].flatten().tolist()),)
        samples.append(sample)
    return samples


def as_tuple(sample, with_routing: bool = False) -> tuple:
    values = (sample.input_ids, sample.loss_mask, sample.advantages, sample.inference_logprobs, sample.temperatures)
    out = tuple(tuple(v) for v in values)
    if with_routing:
        rows = torch.from_numpy(sample.routed_experts.astype(np.int64))
        rows[torch.from_numpy(sample.routed_experts == 255)] = -1
        out += (tuple(rows.flatten().tolist()),)
    return out


@pytest.mark.parametrize(("budget", "num_ranks"), [(8192, 1), (8192, 2), (200, 1), (120, 3)])
def test_groups_become_trees_and_every_sample_reads_back(budget, num_ranks):
    rng = random.Random(budget + num_ranks)
    rollouts = [r for g in range(4) for r in make_group(g, 8, 40 + g, rng)]
    rollouts += make_group(9, 1, 10, rng)  # a group of one: a plain sample
    batches = build_training_batches(3, rollouts, 0.7, budget, num_ranks, {}, shared_prefix=True)
    micro_batches = [mb for b in batches for mb in b.micro_batches]
    assert len(batches) == num_ranks and all(b.micro_batches for b in batches)

    want = sorted(as_tuple(build_sample(r, 0.7)) for r in rollouts)
    assert sorted(s for mb in micro_batches for s in read_back(mb)) == want
    total = sum(len(mb.input_ids) for mb in micro_batches)
    assert total < sum(r.num_tokens for r in rollouts) - 3 * 40  # prompts shared
    for mb in micro_batches:
        assert len(mb.input_ids) <= budget
        packed = to_packed(mb, CPU)  # the trainer accepts it (no loss in a shared prefix, valid positions)
        assert packed.num_tokens == len(mb.input_ids)
        assert build_padded_layout(packed.position_ids_T).num_branches > 0
    assert all(b.num_loss_tokens == sum(len(r.completion_token_ids) for r in rollouts) for b in batches)


def test_one_group_is_split_when_ranks_need_micro_batches():
    rollouts = make_group(0, 6, 20, random.Random(0))
    batches = build_training_batches(1, rollouts, 1.0, 8192, 2, {})
    assert [len(b.micro_batches) for b in batches] == [1, 1]
    for b in batches:
        assert build_padded_layout(torch.tensor(b.micro_batches[0].position_ids)).num_branches == 2  # 3 samples each


def test_shared_prefix_off_gives_plain_packing():
    rng = random.Random(1)
    rollouts = [r for g in range(3) for r in make_group(g, 4, 12, rng)]
    got = build_training_batches(1, rollouts, 0.7, 300, 2, {"m": 1.0}, shared_prefix=False)
    samples = [build_sample(r, 0.7) for r in rollouts]
    want = [[to_micro_batch(b) for b in bins] for bins in distribute(pack_samples(samples, 300), 2)]
    assert [b.micro_batches for b in got] == want
    for mb in (mb for b in got for mb in b.micro_batches):
        assert build_padded_layout(torch.tensor(mb.position_ids)).num_branches == 0


def test_router_replay_rows_stay_with_their_tokens():
    rng = random.Random(2)
    rollouts = [r for g in range(2) for r in make_group(g, 5, 16, rng, routing=True)]
    batches = build_training_batches(1, rollouts, 1.0, 8192, 1, {})
    want = sorted(as_tuple(build_sample(r, 1.0), with_routing=True) for r in rollouts)
    assert sorted(s for mb in batches[0].micro_batches for s in read_back(mb)) == want
    # A prompt row routed differently in one sample stops the shared prefix there (it is not the same computation).
    samples = [build_sample(r, 1.0) for r in rollouts[:5]]
    assert shared_prefix_len(samples) == 16
    samples[3].routed_experts[9, 1, 0] = (samples[3].routed_experts[9, 1, 0] + 1) % 8
    assert shared_prefix_len(samples) == 9


def test_only_loss_free_tokens_are_shared():
    # Multi-turn samples of one group: the first turn's model tokens carry loss, so only the prompt is shared.
    def sample(tokens, mask):
        return TrainingSample(token_ids=tokens, loss_mask=mask, logprobs=[-0.5 if m else 0.0 for m in mask])

    prompt = [1, 2, 3, 4, 5]
    turn = [6, 7, 8]  # the model's first answer, the same in both rollouts
    rollouts = []
    for k in range(2):
        samples = [sample(prompt + turn + [20 + k, 30 + k], [False] * 5 + [True] * 3 + [False, True])]
        rollouts.append(
            Rollout(TASK, prompt, turn, [-0.5] * 3, "", [0] * 3, 0, advantage=0.5 - k, group_index=7, samples=samples)
        )
    all_samples = [s for r in rollouts for s in build_samples(r, 1.0)]
    assert shared_prefix_len(all_samples) == 5
    (mb,) = build_training_batches(1, rollouts, 1.0, 8192, 1, {})[0].micro_batches
    assert mb.position_ids == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9]
    assert sum(mb.loss_mask) == 8
    assert sorted(read_back(mb)) == sorted(as_tuple(s) for s in all_samples)


def test_tree_token_count():
    s = build_sample(make_group(0, 1, 10, random.Random(0))[0], 1.0)
    assert Tree([s, s, s], 10).num_tokens == 10 + 3 * (s.num_tokens - 10)
