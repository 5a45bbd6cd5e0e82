"""The calibrated weight check (orchestrator/weight_check.py) against an inference stand-in whose log-probs are set per
version: the floor is measured on identical weights before the first load (and again before later ones, keeping the
largest), loads are judged against it, a load that left the old policy in place is caught even when it hides in the
noise, and a floor too high stops the run."""

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from slipstream.config.orchestrator import WeightCheckConfig
from slipstream.orchestrator.weight_check import WeightChecker, WeightSyncError, failure_message
from slipstream.rundir import RunDir

TOKENS = list(range(10, 51))
BF16_TOLERANCE = 5e-2


class Engine:
    """Scores a probe as the policy version it serves would: `served[version]` (the cache salt names the version
    the request is for, not the one served, exactly as on a real server)."""

    base_url = "http://engine"

    def __init__(self, logprobs: np.ndarray) -> None:
        self.logprobs = logprobs
        self.calls = 0

    async def score_tokens(self, token_ids: list[int], cache_salt: str) -> list[float]:
        assert token_ids == TOKENS
        self.calls += 1
        return self.logprobs.tolist()


class Client:
    def __init__(self, engine: Engine) -> None:
        self.admin_clients = [engine]


def _policy(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-6.0, -0.1, len(TOKENS) - 1)


def _noise(seed: int, scale: float) -> np.ndarray:
    return np.random.default_rng(100 + seed).uniform(-scale, scale, len(TOKENS) - 1)


def _publish(out: Path, step: int, logprobs: np.ndarray, previous: tuple[int, np.ndarray] | None) -> None:
    probe = {"token_ids": TOKENS, "logprobs": logprobs.tolist()}
    if previous is not None:
        probe |= {"previous_step": previous[0], "previous_logprobs": previous[1].tolist()}
    path = RunDir(out).probe_path(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(probe))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in RunDir(out).weight_checks_path.read_text().splitlines()]


def _checker(out: Path, engine: Engine, **config) -> WeightChecker:
    return WeightChecker(Client(engine), out, WeightCheckConfig(**config), BF16_TOLERANCE)  # type: ignore[arg-type]


def test_the_floor_is_measured_before_the_first_load_and_loads_are_judged_against_it(tmp_path):
    v0, v1 = _policy(0), _policy(0) + _noise(1, 0.2)
    _publish(tmp_path, 1, v1, (0, v0))
    engine = Engine(v0 + _noise(2, 0.1))  # serving v0, with kernel noise of up to 0.1
    checker = _checker(tmp_path, engine)
    floor = asyncio.run(checker.maybe_calibrate(1, served_version=0))
    assert floor is not None and floor.step == 0 and 0.05 < floor.max_abs_diff <= 0.1
    assert checker.allowed() == pytest.approx(3 * floor.max_abs_diff)
    assert asyncio.run(checker.maybe_calibrate(1, served_version=0)) is floor and engine.calls == 1  # once a version
    engine.logprobs = v1 + _noise(3, 0.1)  # the load took effect: noise as large as the floor's
    check = asyncio.run(checker.verify(1, previous_version=0))
    assert check["passed"] and not check["frozen"] and check["max_abs_diff"] > BF16_TOLERANCE
    assert check["margin"] == pytest.approx(check["allowed"] - check["max_abs_diff"]) and check["margin"] > 0
    calibration, update = _records(tmp_path)
    assert calibration["kind"] == "calibration" and calibration["max_abs_diff"] == floor.max_abs_diff
    per_token = np.abs(np.subtract(calibration["inference_logprobs"], calibration["trainer_logprobs"]))
    assert per_token.max() == pytest.approx(floor.max_abs_diff) and len(per_token) == len(v0)
    assert update["kind"] == "update" and update["floor_max"] == floor.max_abs_diff and update["step"] == 1


def test_a_load_that_left_the_old_policy_is_caught_inside_the_noise(tmp_path):
    v0 = _policy(0)
    v1 = v0 + 0.06  # the trainer's policy moved by less than allowed (3 x 0.03) but well beyond the floor's mean
    _publish(tmp_path, 1, v1, (0, v0))
    engine = Engine(v0 + _noise(2, 0.03))
    checker = _checker(tmp_path, engine)
    asyncio.run(checker.maybe_calibrate(1, served_version=0))
    engine.logprobs = v0 + _noise(4, 0.03)  # frozen: still v0
    check = asyncio.run(checker.verify(1, previous_version=0))
    assert check["max_abs_diff"] <= check["allowed"]  # the difference alone would pass
    assert check["frozen"] and not check["passed"]
    assert "closer to the previous version" in failure_message(check, tmp_path)
    engine.logprobs = v1 + _noise(5, 0.03)  # taken: closer to v1
    assert asyncio.run(checker.verify(1, previous_version=0))["passed"]


def test_a_move_within_the_noise_is_not_called_frozen(tmp_path):
    v0 = _policy(0)
    v1 = v0 + 0.001
    _publish(tmp_path, 1, v1, (0, v0))
    engine = Engine(v0 + _noise(2, 0.03))
    checker = _checker(tmp_path, engine)
    asyncio.run(checker.maybe_calibrate(1, served_version=0))
    for seed in range(6, 16):  # whichever way the noise falls
        engine.logprobs = v1 + _noise(seed, 0.03)
        check = asyncio.run(checker.verify(1, previous_version=0))
        assert check["passed"] and not check["frozen"], check


def test_a_high_floor_stops_the_run_before_any_load(tmp_path):
    v0 = _policy(0)
    _publish(tmp_path, 1, v0, (0, v0))
    checker = _checker(tmp_path, Engine(_policy(7)))  # another model
    with pytest.raises(WeightSyncError, match=r"before any weight update.*max_floor = 1"):
        asyncio.run(checker.maybe_calibrate(1, served_version=0))
    assert _records(tmp_path)[0]["kind"] == "calibration"
    warned = _checker(tmp_path, Engine(_policy(7)), stop_on_failure=False)  # not stopping: the floor is not adopted
    assert asyncio.run(warned.maybe_calibrate(1, served_version=0)) is None
    assert warned.allowed() == BF16_TOLERANCE and warned.measured
    assert asyncio.run(warned.maybe_calibrate(1, served_version=0)) is None and len(_records(tmp_path)) == 2  # once


def test_no_calibration_without_the_served_versions_logprobs_and_a_fixed_bound_stays_fixed(tmp_path):
    v0, v2 = _policy(0), _policy(2)
    _publish(tmp_path, 2, v2, (1, v0))  # v1 was skipped: its previous is not what inference serves (v0)
    engine = Engine(v0)
    checker = _checker(tmp_path, engine)
    assert asyncio.run(checker.maybe_calibrate(2, served_version=0)) is None and engine.calls == 0
    assert checker.allowed() == BF16_TOLERANCE
    _publish(tmp_path, 3, v2, (2, v0))
    fixed = _checker(tmp_path, Engine(v0 + _noise(2, 0.1)), max_abs_diff=0.02)
    assert asyncio.run(fixed.maybe_calibrate(3, served_version=2)) is not None
    assert fixed.allowed() == 0.02
    off = _checker(tmp_path, Engine(v0), calibrate=False)
    assert asyncio.run(off.maybe_calibrate(3, served_version=2)) is None
    check = asyncio.run(
        _checker(tmp_path, Engine(v2)).verify(2, previous_version=0)
    )  # no previous of v0: no frozen test
    assert check["passed"] and "moved_mean" not in check


def test_loads_that_pass_raise_the_floor_within_max_floor_rise(tmp_path):
    """The gap grows as the policy trains (SmolLM2 in float32 on an H200: 2-4x over 50 steps; a floor fixed at the
    start stopped healthy runs). Each passed load is a measurement on identical weights: the floor follows them, up to
    max_floor_rise x the starting floor, so a divergence that keeps growing still fails."""
    versions = [_policy(0) + 0.5 * k for k in range(7)]  # each version moves every token by 0.5
    engine = Engine(versions[0] + _noise(1, 0.01))
    _publish(tmp_path, 1, versions[1], (0, versions[0]))
    checker = _checker(tmp_path, engine)  # floor_factor 3, max_floor_rise 4
    start = asyncio.run(checker.maybe_calibrate(1, served_version=0))
    assert start is not None and 0.008 < start.max_abs_diff <= 0.01

    def load(version: int, noise: float, seed: int, served: int | None = None) -> dict:
        _publish(tmp_path, version, versions[version], (version - 1, versions[version - 1]))
        engine.logprobs = versions[version if served is None else served] + _noise(seed, noise)
        return asyncio.run(checker.verify(version, previous_version=version - 1))

    one = load(1, 0.025, 2)  # within 3x the starting floor: passes and raises the floor to its difference
    assert one["passed"] and one["raised_floor"] and one["floor_max"] == start.max_abs_diff
    assert checker.floor.max_abs_diff == one["max_abs_diff"] and checker.floor.step == 1
    two = load(2, 0.06, 3)  # over 3x the starting floor, within 3x the raised one; the floor rises to its cap
    assert two["max_abs_diff"] > 3 * start.max_abs_diff and two["passed"] and two["raised_floor"]
    assert checker.floor.max_abs_diff == pytest.approx(4 * start.max_abs_diff)
    assert checker.floor.max_abs_diff < two["max_abs_diff"]
    three = load(3, 0.11, 4)  # within 3x the capped floor: passes, and the floor stays at its cap
    assert three["passed"] and not three["raised_floor"] and three["allowed"] == pytest.approx(12 * start.max_abs_diff)
    four = load(4, 0.2, 5)  # a divergence past the cap fails, and a failed load never raises the floor
    assert not four["passed"] and not four["raised_floor"]
    assert checker.floor.max_abs_diff == pytest.approx(4 * start.max_abs_diff)
    five = load(5, 0.01, 6, served=4)  # still version 4 served: frozen, even with the floor raised
    assert five["frozen"] and not five["passed"]
    assert [r["kind"] for r in _records(tmp_path)] == ["calibration"] + ["update"] * 5

    fixed = _checker(tmp_path, Engine(versions[0] + _noise(1, 0.01)), max_floor_rise=1.0)
    asyncio.run(fixed.maybe_calibrate(1, served_version=0))
    fixed.client.admin_clients[0].logprobs = versions[1] + _noise(2, 0.025)
    assert not asyncio.run(fixed.verify(1, previous_version=0))["raised_floor"]
    assert fixed.floor == fixed.start_floor
