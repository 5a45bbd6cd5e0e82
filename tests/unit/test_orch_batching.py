"""Packing invariants: every token once, micro-batch budget, rank balance, loss-token count, array alignment."""

import random

import pytest

from slipstream.envs.base import Task
from slipstream.orchestrator.batching import build_sample, build_training_batches, distribute, pack_samples
from slipstream.rollout.record import Rollout
from slipstream.transport.rollouts import read_batch, write_batch

TASK = Task(id="t", prompt=[])


def make_rollout(idx: int, num_prompt: int, num_completion: int, advantage: float) -> Rollout:
    # Token ids encode (rollout, position) so every token can be traced back.
    base = idx * 100_000
    return Rollout(
        task=TASK,
        prompt_token_ids=[base + i for i in range(num_prompt)],
        completion_token_ids=[base + num_prompt + i for i in range(num_completion)],
        completion_logprobs=[-0.01 * (i + 1) - idx for i in range(num_completion)],
        completion_text="",
        token_versions=[0] * num_completion,
        request_version=0,
        advantage=advantage,
    )


def make_rollouts(n: int, seed: int = 0, max_len: int = 300) -> list[Rollout]:
    rng = random.Random(seed)
    return [make_rollout(i, rng.randint(1, 40), rng.randint(1, max_len), rng.uniform(-1, 1)) for i in range(n)]


def test_sample_alignment():
    r = make_rollout(3, 4, 5, advantage=0.7)
    s = build_sample(r, temperature=0.8)
    assert s.input_ids == r.prompt_token_ids + r.completion_token_ids
    assert s.loss_mask == [False] * 4 + [True] * 5
    assert s.advantages == [0.0] * 4 + [0.7] * 5
    assert s.inference_logprobs == [0.0] * 4 + r.completion_logprobs
    assert s.temperatures == [1.0] * 4 + [0.8] * 5


def test_sample_length_mismatch_is_an_error():
    r = make_rollout(0, 2, 3, 0.0)
    r.completion_logprobs = r.completion_logprobs[:-1]
    with pytest.raises(ValueError, match="3 completion tokens but 2 logprobs"):
        build_sample(r, 1.0)


def test_packing_respects_budget_and_oversized_samples():
    samples = [build_sample(r, 1.0) for r in make_rollouts(40, max_len=300)]
    samples.append(build_sample(make_rollout(99, 10, 1000, 0.1), 1.0))  # longer than the budget
    bins = pack_samples(samples, micro_batch_tokens=512)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in samples)
    for b in bins:
        assert sum(s.num_tokens for s in b) <= 512 or len(b) == 1


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("budget", [256, 1024, 8192])
def test_training_batches_invariants(tmp_path, num_ranks, budget):
    rollouts = make_rollouts(16, seed=num_ranks * budget)
    batches = build_training_batches(5, rollouts, 0.7, budget, num_ranks, {"reward/mean": 0.5})
    assert [b.rank for b in batches] == list(range(num_ranks))
    expected_loss_tokens = sum(len(r.completion_token_ids) for r in rollouts)
    assert all(b.num_loss_tokens == expected_loss_tokens for b in batches)
    assert all(b.step == 5 and b.metrics == {"reward/mean": 0.5} for b in batches)
    assert all(len(b.micro_batches) >= 1 for b in batches)

    seen: list[int] = []
    by_rollout = {r.prompt_token_ids[0] // 100_000: r for r in rollouts}
    for batch in batches:
        for mb in batch.micro_batches:
            n = len(mb.input_ids)
            assert n <= budget or mb.position_ids.count(0) == 1
            assert {len(mb.position_ids), len(mb.loss_mask), len(mb.advantages)} == {n}
            assert {len(mb.inference_logprobs), len(mb.temperatures)} == {n}
            for t, tok in enumerate(mb.input_ids):
                r = by_rollout[tok // 100_000]
                pos = tok % 100_000
                assert mb.position_ids[t] == pos
                is_completion = pos >= len(r.prompt_token_ids)
                assert mb.loss_mask[t] == is_completion
                if is_completion:
                    k = pos - len(r.prompt_token_ids)
                    assert mb.advantages[t] == r.advantage
                    assert mb.inference_logprobs[t] == r.completion_logprobs[k]
                    assert mb.temperatures[t] == 0.7
                else:
                    assert (mb.advantages[t], mb.inference_logprobs[t], mb.temperatures[t]) == (0.0, 0.0, 1.0)
            seen += mb.input_ids
    assert sorted(seen) == sorted(t for r in rollouts for t in r.prompt_token_ids + r.completion_token_ids)

    # Round-trips through the wire format.
    for batch in batches:
        assert read_batch(write_batch(tmp_path, batch)) == batch


def test_rank_balance():
    rollouts = make_rollouts(64, seed=3)
    batches = build_training_batches(1, rollouts, 1.0, 1024, 4, {})
    loads = [sum(len(mb.input_ids) for mb in b.micro_batches) for b in batches]
    largest_mb = max(len(mb.input_ids) for b in batches for mb in b.micro_batches)
    assert max(loads) - min(loads) <= largest_mb
    assert len({len(b.micro_batches) for b in batches}) == 1  # equal counts when samples allow


def test_few_micro_batches_are_split_over_ranks():
    # Everything fits one micro-batch, but each of 4 ranks must get one.
    rollouts = make_rollouts(6, max_len=10)
    bins = pack_samples([build_sample(r, 1.0) for r in rollouts], 8192)
    assert len(bins) == 1
    per_rank = distribute(bins, 4)
    assert all(len(rank) >= 1 for rank in per_rank)
    assert sum(len(b) for rank in per_rank for b in rank) == 6


def test_too_few_samples_for_ranks():
    bins = pack_samples([build_sample(r, 1.0) for r in make_rollouts(2)], 8192)
    with pytest.raises(ValueError, match="orchestrator.batch_size"):
        distribute(bins, 3)
