"""Group bookkeeping: staleness thresholds per batch, cancel/drop counters (exact), quotas, oldest versions."""

from slipstream.envs.base import Task
from slipstream.orchestrator.ledger import Group, GroupLedger
from slipstream.rollout.record import Rollout
from slipstream.rollout.streaming import StreamedChat


def group(index: int, version: int) -> Group:
    return Group(index=index, task=Task(id=f"t{index}", prompt=[]), request_version=version, task_index=index)


def rollouts(g: Group, *token_versions: list[int]) -> list[Rollout]:
    return [
        Rollout(g.task, [1], [7] * len(v), [-1.0] * len(v), "", token_versions=v, request_version=g.request_version)
        for v in token_versions
    ]


def test_stale_groups_are_cancelled_in_flight_or_dropped_from_the_buffer_and_counted_exactly():
    ledger = GroupLedger(groups_per_batch=1, max_off_policy_steps=1)
    g = [group(i, 0) for i in range(4)]
    for x in g:
        ledger.start(x)
    assert ledger.finish(g[0], rollouts(g[0], [0, 0], [0]))
    assert ledger.take_batch() == [g[0]] and ledger.sweep() == []  # batch 2 accepts version >= 0
    assert ledger.finish(g[1], rollouts(g[1], [0, 1], [1, 1]))  # spans an update; oldest token is version 0
    assert ledger.finish(g[2], rollouts(g[2], [0]))
    assert ledger.take_batch() == [g[1]]
    assert ledger.sweep() == [g[3]]  # batch 3 accepts version >= 1: g[2] is dropped, g[3] cancelled in flight
    assert (ledger.num_dropped, ledger.num_cancelled, list(ledger.finished), ledger.in_flight) == (1, 1, [], {})

    late = group(4, 1)
    ledger.start(late)
    assert ledger.finish(late, rollouts(late, [1, 2]))
    assert ledger.take_batch() == [late] and ledger.sweep() == []
    stale_on_arrival = group(5, 1)
    ledger.start(stale_on_arrival)
    assert not ledger.finish(stale_on_arrival, rollouts(stale_on_arrival, [1, 2]))  # batch 4 needs >= 2
    assert (ledger.num_batches, ledger.num_dispatched, ledger.num_dropped, ledger.num_cancelled) == (3, 6, 2, 1)


def test_take_waits_for_a_full_batch_first_finished_first_in_dispatch_order():
    ledger = GroupLedger(groups_per_batch=2, max_off_policy_steps=8)
    g = [group(i, 0) for i in range(3)]
    for x in g:
        ledger.start(x)
    ledger.finish(g[2], rollouts(g[2], [0]))
    assert ledger.take_batch() is None
    ledger.finish(g[0], rollouts(g[0], [0]))
    assert ledger.take_batch() == [g[0], g[2]] and ledger.num_batches == 1  # g[1] is still in flight
    extra = group(3, 0)
    ledger.start(extra)
    ledger.finish(extra, rollouts(extra, [0]))
    assert ledger.abandon_all() == [g[1]] and ledger.num_abandoned == 2  # in flight, and finished but unused
    assert not ledger.finished


def test_quota_counts_what_allowed_batches_still_need():
    ledger = GroupLedger(groups_per_batch=3, max_off_policy_steps=1)
    assert ledger.quota(last_allowed_batch=2) == 6
    for i in range(4):
        ledger.start(group(i, 0))
    ledger.finish(ledger.in_flight[0], rollouts(group(0, 0), [0]))
    assert ledger.quota(2) == 2 and ledger.quota(1) == -1


def test_oldest_version_in_flight():
    g = group(0, 3)
    assert g.oldest_version() == 3  # whole replies: the request's version bounds every token from below
    g.stream = StreamedChat(1, lambda: 5, "here")
    assert g.oldest_version() is None  # streamed, no token yet: tokens to come are fresh
    g.stream.add({"choices": [{"index": 0, "token_ids": [9], "logprobs": {"content": [{"logprob": -1.0}]}}]})
    assert g.oldest_version() == 5
    ledger = GroupLedger(groups_per_batch=1, max_off_policy_steps=0)
    fresh = group(0, 0)
    fresh.stream = StreamedChat(1, lambda: 0, "here")
    ledger.start(fresh)
    ledger.num_batches = 4  # the next batch needs version >= 4, but a stream without tokens is not stale yet
    assert ledger.sweep() == []
