"""The planner's pipeline simulation keeps the orchestrator's semantics: synchronous at max_async_level 0, token lag
bounded by max_off_policy_steps (and by max_async_level without a latency tail or spare groups), cancellation and
dropping counted exactly, tokens stamped with the version served when they were due; bad settings name the field."""

import pytest
from pydantic import ValidationError

from slipstream.planner.distributions import TailDist, constant
from slipstream.planner.engine import SimSequence, SimServer, VersionLog
from slipstream.planner.pipeline_sim import PipelineSim, simulate
from slipstream.planner.sim_config import PipelineSimConfig


def config(**over) -> PipelineSimConfig:
    base = dict(
        num_steps=20,
        batch_size=32,
        group_size=8,
        max_async_level=1,
        in_flight_limit=32,
        capacity=32,
        sequence_latency=TailDist(p50=0.05, tail_ratio=20),
        completion_tokens=constant(16),
        train_step_s=0.3,
        weight_update_s=0.01,
        version_tracking="reply",
    )
    return PipelineSimConfig(**{**base, **over})


def test_async_level_0_is_synchronous():
    sync = simulate(config(max_async_level=0))
    assert sync.lag_mean == 0 and sync.lag_max == 0 and set(sync.lag_hist) == {0}
    assert sync.multi_version == 0 and sync.num_cancelled == sync.num_dropped == 0
    # no overlap: every step takes the train step plus a whole generation
    assert min(sync.step_s[1:]) > 0.3 + 0.05
    assert simulate(config(max_async_level=1)).steps_per_hour > sync.steps_per_hour


@pytest.mark.parametrize("level", [1, 2, 4])
@pytest.mark.parametrize("tail", [1.0, 30.0])
def test_lag_is_bounded(level, tail):
    r = simulate(
        config(
            max_async_level=level, max_off_policy_steps=level + 1, sequence_latency=TailDist(p50=0.05, tail_ratio=tail)
        )
    )
    assert 0 <= r.lag_max <= level + 1  # never older than max_off_policy_steps
    assert min(r.lag_hist) >= 0


@pytest.mark.parametrize("level", [1, 3])
def test_without_tail_or_spares_lag_stays_within_the_async_level(level):
    r = simulate(config(max_async_level=level, spare_batches=0, sequence_latency=constant(0.05), train_step_s=0.05))
    assert r.lag_max <= level
    assert r.lag_mean > 0


def test_every_trained_token_is_counted_once():
    c = config(num_steps=12, completion_tokens=TailDist(p50=20, tail_ratio=3, max=64))
    r = simulate(c)
    tokens = sum(r.lag_hist.values())
    assert 12 * c.batch_size <= tokens <= 12 * c.batch_size * 64


def test_cancellation_counts_are_exact():
    c = config(num_steps=30, max_off_policy_steps=1, spare_batches=2, train_step_s=0.1, capacity=32)
    sim = PipelineSim(c)
    r = sim.run()
    ledger = sim.ledger
    assert r.num_cancelled > 0  # spare groups started long ago go too old in flight
    left = len(ledger.in_flight) + len(ledger.finished)
    trained = 30 * c.batch_size // c.group_size
    assert ledger.num_dispatched == trained + r.num_cancelled + r.num_dropped + left
    assert r.lag_max <= 1
    # a generous bound cancels nothing
    assert simulate(c.model_copy(update={"max_off_policy_steps": 50})).num_cancelled == 0


def test_stream_tracking_cancels_no_earlier_than_reply():
    """Whole replies use the request's version (a lower bound), streamed tokens their own: stream cancels less."""
    c = config(num_steps=30, max_off_policy_steps=1, spare_batches=2, train_step_s=0.1)
    reply = simulate(c)
    stream = simulate(c.model_copy(update={"version_tracking": "stream"}))
    assert stream.num_cancelled <= reply.num_cancelled


def test_multi_turn_with_tool_latency_is_slower():
    one = simulate(config(max_async_level=0))
    three = simulate(config(max_async_level=0, num_turns=3, env_latency=constant(0.2)))
    assert three.steps_per_hour < one.steps_per_hour
    assert three.rollout_latency_p50_s > one.rollout_latency_p50_s + 0.4


def test_tokens_take_the_version_served_when_due():
    server = SimServer(capacity=1)
    seq = SimSequence(num_tokens=10, work_s=1.0)
    server.submit(seq)
    server.advance(0.45)  # tokens 1..4 due (at 0.1 .. 0.4)
    server.freeze()
    server.advance(5.0)  # frozen: no progress
    server.resume(version=3)
    assert server.next_finish() == pytest.approx(5.55)
    server.advance(5.55)
    assert server.pop_finished() == [seq]
    assert server.log.token_counts(seq) == [(0, 4), (3, 6)]
    log = VersionLog()
    log.switch(0.5, 1)
    assert log.version_at(0.5) == 0 and log.version_at(0.51) == 1  # due at the freeze: emitted before it


def test_cancel_frees_the_slot():
    server = SimServer(capacity=1)
    a, b = SimSequence(num_tokens=1, work_s=10.0), SimSequence(num_tokens=1, work_s=1.0)
    server.submit(a)
    server.submit(b)
    server.cancel(a)
    assert server.next_finish() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"batch_size": 30}, "group_size"),
        ({"max_async_level": 3, "max_off_policy_steps": 2}, "max_off_policy_steps"),
        ({"capacity": 0}, "capacity"),
        ({"train_step_s": -1.0}, "train_step_s"),
    ],
)
def test_bad_settings_name_the_field(over, field):
    with pytest.raises(ValidationError, match=field):
        config(**over)


def test_bad_distribution_names_the_field():
    with pytest.raises(ValidationError, match="tail_ratio"):
        TailDist(p50=1.0, tail_ratio=0.5)
    with pytest.raises(ValidationError, match="p50"):
        TailDist(p50=-1.0)


def test_dispatch_rule_is_the_pipelines():
    """The simulation restates RolloutPipeline._dispatch_state; run the pipeline's own method on the simulation's
    state at every step of a run and check both decide alike (catches drift if the orchestrator's rule changes)."""
    from types import SimpleNamespace

    from slipstream.orchestrator.pipeline import RolloutPipeline

    c = config(num_steps=15, max_async_level=2, max_off_policy_steps=2, spare_batches=1, capacity=24)
    sim = PipelineSim(c)
    checked = []
    react = sim._react

    def compare_then_react():
        view = SimpleNamespace(
            error=None,
            relay=SimpleNamespace(accepting=sim.accepting, served_version=sim.served),
            config=SimpleNamespace(max_steps=c.num_steps, max_async_level=c.max_async_level),
            num_spare=sim.num_spare,
            _trainer_waited=sim.trainer_waited,
            ledger=sim.ledger,
            _num_in_flight=lambda: len(sim.ledger.in_flight) * c.group_size,
            group_size=c.group_size,
            limit=sim.limit,
            _trainer_turn=lambda: False,  # the simulation plans side-by-side runs, never colocated ones
        )
        checked.append((RolloutPipeline._dispatch_state(view), sim._dispatch_state()))
        react()

    sim._react = compare_then_react
    sim.run()
    assert len(checked) > 100 and all(a == b for a, b in checked)
    assert {b for _, b in checked} == {"go", "limit", "hold"}
