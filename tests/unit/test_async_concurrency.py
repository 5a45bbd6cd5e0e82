"""Adaptive in-flight concurrency: /metrics parsing and the AIMD rule (slow start, back-off on queueing or
preemption, additive growth), plus config validation."""

import pytest
from pydantic import ValidationError

from slipstream.config.orchestrator import ConcurrencyConfig
from slipstream.orchestrator.concurrency import InFlightLimit, ServerLoad, parse_server_load
from slipstream.rollout.client import InferenceError

METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7956600854047039e+09
"""


def test_server_load_sums_engines_and_ignores_lookalike_series():
    assert parse_server_load(METRICS, "m") == ServerLoad(num_waiting=3.0, num_preemptions=5.0)
    sim = 'vllm:num_requests_running{model_name="sim"} 4.0\nvllm:num_requests_waiting{model_name="sim"} 0.0\n'
    assert parse_server_load(sim, "m") == ServerLoad(num_waiting=0.0, num_preemptions=None)
    with pytest.raises(InferenceError, match="mode = 'fixed'"):
        parse_server_load("vllm:num_requests_running 1.0\n", "http://x/metrics")
    with pytest.raises(InferenceError, match="not a Prometheus text exposition"):
        parse_server_load("vllm:num_requests_waiting{engine=0 oops\n", "http://x/metrics")


def idle(waiting: float = 0.0, preemptions: float | None = 0.0) -> ServerLoad:
    return ServerLoad(num_waiting=waiting, num_preemptions=preemptions)


def test_slow_start_then_back_off_then_additive_growth():
    limit = InFlightLimit(ConcurrencyConfig(min=4, max=100, increase=3, backoff_factor=0.5, waiting_polls=2))
    assert limit.limit == 4
    assert [limit.observe(idle(), saturated=True, in_flight=0) for _ in range(3)] == [8, 16, 32]
    assert limit.observe(idle(), saturated=False, in_flight=0) == 32  # the limit did not hold anything back: no growth
    assert limit.observe(idle(waiting=1), saturated=True, in_flight=32) == 32  # one poll with queueing is tolerated
    assert limit.observe(idle(waiting=3), saturated=True, in_flight=32) == 16  # two in a row: back off
    assert limit.num_backoffs == 1 and not limit.slow_start
    grown = [limit.observe(idle(), saturated=True, in_flight=0) for _ in range(2)]
    assert grown == [19, 22]  # additive after a back-off
    assert limit.observe(idle(preemptions=1.0), saturated=True, in_flight=22) == 11  # preemption: back off at once
    assert limit.observe(idle(preemptions=1.0), saturated=False, in_flight=11) == 11  # counter unchanged: no back-off


def test_queue_of_our_own_excess_after_a_back_off_does_not_back_off_again():
    limit = InFlightLimit(ConcurrencyConfig(min=2, max=64, backoff_factor=0.5, waiting_polls=1))
    limit.limit = 16
    assert limit.observe(idle(waiting=4), saturated=False, in_flight=16) == 8
    assert limit.observe(idle(waiting=4), saturated=False, in_flight=16) == 8  # shedding the excess
    assert limit.observe(idle(preemptions=1.0), saturated=False, in_flight=12) == 8
    assert limit.observe(idle(waiting=1), saturated=False, in_flight=8) == 4  # queueing at the new limit


def test_limits_stay_in_range():
    limit = InFlightLimit(ConcurrencyConfig(min=4, max=10, backoff_factor=0.1, waiting_polls=1))
    assert [limit.observe(idle(), True, 0) for _ in range(3)] == [8, 10, 10]
    assert limit.observe(idle(waiting=5), True, 10) == 4
    assert InFlightLimit(ConcurrencyConfig(mode="fixed", min=4, max=10)).limit == 10
    assert limit.observe(idle(preemptions=None), True, 4) == 10  # no preemption counter (simulator): queueing only


def test_min_above_max_says_what_to_change():
    with pytest.raises(ValidationError, match=r"concurrency.min \(20\) is above concurrency.max \(10\)"):
        ConcurrencyConfig(min=20, max=10)
