"""The planner's pipeline simulation against two measured runs (benchmarks/plan_validation.py; all six settings
and their figures are in benchmarks/RESULTS.md): the real orchestrator and the simulated inference server with
async_vs_sync.py's fake trainer, predicted vs measured steps/hour and mean token lag within 15%. One setting is
inference-heavy with a latency tail, the other cancels groups in flight (max_off_policy_steps = 1)."""

import pytest

from tests.benchmark_scripts import load_benchmark

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("plan_validation")


@pytest.mark.parametrize("name", ["async1_tail20", "async1_offpolicy1_cap32"])
def test_prediction_within_15_percent_of_a_measured_run(bench, name):
    measured, paired, _, ok = bench.compare(name, steps=20)
    assert ok, f"{name}: measured {measured}, predicted {paired}"
    if name == "async1_offpolicy1_cap32":
        assert measured["cancelled"] > 0 and paired["cancelled"] > 0
        assert paired["cancelled"] == pytest.approx(measured["cancelled"], abs=max(3, 0.3 * measured["cancelled"]))
