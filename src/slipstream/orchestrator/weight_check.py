"""Weight checks: after each load, the trainer's probe (the log-probs of a fixed text under the version it published) is
scored on inference and compared, so a failed or partial weight update is caught instead of training silently.

Calibrated against the noise floor: trainer and inference never agree exactly (other kernels, other rounding; at bf16 on
a large model the gap reaches tenths of a nat). Each probe also carries the trainer's log-probs of the version before it
(`previous_logprobs`). Before the first load of a run, while inference still serves that version, they are scored on
inference: the difference on identical weights is the floor. Every load that passes then serves the trainer's weights,
so its difference is one more such measurement: the floor follows the largest of them, up to weight_check.max_floor_rise
times the starting floor (the gap grows as the policy trains, and one measurement of a short probe is noisy; the cap
keeps a steadily growing divergence from raising the floor with it). A load then passes if its max |diff| is at most
`allowed` = max(the dtype's tolerance, floor_factor x the floor's max) (or exactly weight_check.max_abs_diff when set).
Since a small update can move the probe less than the noise, the previous version's log-probs also catch a load that
left the old policy in place: when the trainer's policy moved clearly (mean move over floor_factor x the floor's mean),
inference must be closer to the new log-probs than to the old ones.

weight_checks.jsonl gets a line per calibration (`"kind": "calibration"`) and per check (`"kind": "update"`), with the
floor, the allowed difference and the margin left.
"""

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from slipstream.config.orchestrator import WeightCheckConfig
from slipstream.orchestrator.client import InferenceClient
from slipstream.rollout.record import cache_salt
from slipstream.rundir import RunDir
from slipstream.utils.fs import append_line
from slipstream.weights.wire.published import read_probe

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """Inference log-probs disagree with the trainer's after a weight update (or before any, beyond max_floor)."""


@dataclass(frozen=True)
class Floor:
    """|trainer - inference| on the probe with both on the same weights (version `step`)."""

    step: int
    max_abs_diff: float
    mean_abs_diff: float


@dataclass(frozen=True)
class Scored:
    """Inference's log-probs of a probe's tokens on its worst engine (behind a router every engine is scored)."""

    logprobs: np.ndarray
    max_abs_diff: float
    mean_abs_diff: float
    engine: str
    num_engines: int


class WeightChecker:
    """Calibrates (`maybe_calibrate`, before a load) and checks (`verify`, after it) the loads of one run."""

    def __init__(
        self,
        client: InferenceClient,
        output_dir: Path,
        config: WeightCheckConfig,
        base_tolerance: float,
        per_position: bool = False,
    ) -> None:
        """`base_tolerance`: the dtype's (OrchestratorConfig.weight_check_tolerance). `per_position`: score without
        prompt log-probs, one forced token per request (LoRA adapters need it; not calibrated)."""
        self.client, self.config, self.per_position = client, config, per_position
        self.output_dir = Path(output_dir).resolve()
        self.base_tolerance = base_tolerance
        self.floor: Floor | None = None
        self.measured = False
        """Whether the floor was measured (once a run; a floor over max_floor is measured but not adopted)."""
        self.start_floor: Floor | None = None
        """The floor measured on the starting weights (the one the floor may rise from, max_floor_rise)."""

    def allowed(self) -> float:
        """The largest max |diff| a load may show."""
        cfg = self.config
        if cfg.max_abs_diff is not None:
            return cfg.max_abs_diff
        if self.floor is None:
            return self.base_tolerance
        return max(self.base_tolerance, cfg.floor_factor * self.floor.max_abs_diff)

    async def maybe_calibrate(self, version: int, served_version: int) -> Floor | None:
        """Before loading `version`: if no floor is known yet and its probe carries the trainer's log-probs of the
        served version, score them on inference (still serving it) and keep the result as the floor. Returns the
        floor (None while none could be measured)."""
        cfg = self.config
        if self.measured or not cfg.enabled or not cfg.calibrate or self.per_position:
            return self.floor
        probe = read_probe(self.output_dir, version)
        if probe.get("previous_step") != served_version or "previous_logprobs" not in probe:
            return None
        previous = np.asarray(probe["previous_logprobs"], dtype=np.float64)
        scored = await self._score(probe["token_ids"], previous, served_version)
        floor, self.measured = Floor(served_version, scored.max_abs_diff, scored.mean_abs_diff), True
        if floor.max_abs_diff <= cfg.max_floor:  # a floor above it would let any load pass: never adopted
            self.floor = self.start_floor = floor
        record = {"kind": "calibration", **asdict(floor), "num_tokens": len(previous)}
        record |= {"allowed": self.allowed(), "worst_engine": scored.engine, "num_engines": scored.num_engines}
        # per token, as update records have them: where a later load's difference sits against the floor's
        record |= {"trainer_logprobs": previous.tolist(), "inference_logprobs": scored.logprobs.tolist()}
        append_line(RunDir(self.output_dir).weight_checks_path, json.dumps(record))
        log.info(
            f"weight check calibrated on policy v{served_version}: trainer vs inference on the same weights differ by "
            f"max {scored.max_abs_diff:.3g} (mean {scored.mean_abs_diff:.3g}); loads may differ by {self.allowed():.3g}"
        )
        if self.floor is None:
            self._fail(
                f"before any weight update, inference and the trainer disagree on policy v{served_version} (the same "
                f"weights) by max {scored.max_abs_diff:.3g} log-prob (mean {scored.mean_abs_diff:.3g}), over "
                f"orchestrator.weight_check.max_floor = {cfg.max_floor:g}: they do not run the same model (model.name, "
                "revision, dtype), or their numerics differ more than a check can see through; raise max_floor if "
                "this model is that ill-conditioned (without stop_on_failure, loads keep the dtype's tolerance)"
            )
        return self.floor

    async def verify(self, version: int, previous_version: int | None, after_restart: bool = False) -> dict:
        """Score version `version`'s probe on inference, judge it, append the record, return it. `previous_version`:
        what inference served before this load (its log-probs, when the probe has them, catch a load that did not
        take effect)."""
        probe = read_probe(self.output_dir, version)
        expected = np.asarray(probe["logprobs"], dtype=np.float64)
        scored = await self._score(probe["token_ids"], expected, version)
        check = judge(scored, expected, _previous(probe, previous_version), self)
        check["raised_floor"] = self._take_into_floor(check, version)
        check |= {
            "kind": "update",
            "step": version,
            "num_tokens": len(expected),
            "after_restart": after_restart,
            "scoring": "per_position" if self.per_position else "prompt_logprobs",
            "inference_logprobs": scored.logprobs.tolist(),
            "num_engines": scored.num_engines,
            "worst_engine": scored.engine,
        }
        append_line(RunDir(self.output_dir).weight_checks_path, json.dumps(check))
        return check

    def _take_into_floor(self, check: dict, version: int) -> bool:
        """Raise the floor to a passed load's differences, within max_floor_rise of the starting floor; True if the
        load raised it."""
        floor, start = self.floor, self.start_floor
        if not check["passed"] or floor is None or start is None:  # no floor: nothing calibrated to raise
            return False
        rise = self.config.max_floor_rise
        new_max = min(max(floor.max_abs_diff, check["max_abs_diff"]), rise * start.max_abs_diff)
        new_mean = min(max(floor.mean_abs_diff, check["mean_abs_diff"]), rise * start.mean_abs_diff)
        if new_max <= floor.max_abs_diff and new_mean <= floor.mean_abs_diff:
            return False
        self.floor = Floor(version, new_max, new_mean)
        if new_max > floor.max_abs_diff:
            log.debug(f"weight check floor raised by the load of v{version}: loads may differ by {self.allowed():.3g}")
        return True

    async def _score(self, token_ids: list[int], expected: np.ndarray, version: int) -> Scored:
        engines = self.client.admin_clients  # behind a router: every engine, each must have taken the update
        scored = []
        for engine in engines:
            score = engine.score_tokens_per_position if self.per_position else engine.score_tokens
            got = np.asarray(await score(list(token_ids), cache_salt(version)), dtype=np.float64)
            diff = np.abs(got - expected)
            scored.append(Scored(got, float(diff.max()), float(diff.mean()), engine.base_url, len(engines)))
        return max(scored, key=lambda s: s.max_abs_diff)  # the worst engine

    def _fail(self, message: str) -> None:
        if self.config.stop_on_failure:
            raise WeightSyncError(message)
        log.warning(message)


def _previous(probe: dict, previous_version: int | None) -> np.ndarray | None:
    if previous_version is None or probe.get("previous_step") != previous_version:
        return None
    previous = probe.get("previous_logprobs")
    return None if previous is None else np.asarray(previous, dtype=np.float64)


def judge(scored: Scored, expected: np.ndarray, previous: np.ndarray | None, checker: WeightChecker) -> dict:
    """The verdict on one load: the max |diff| within `allowed`, and (when the trainer's policy moved clearly beyond
    the floor) inference closer to the new version's log-probs than to the previous version's."""
    allowed, floor = checker.allowed(), checker.floor
    check = {
        "max_abs_diff": scored.max_abs_diff,
        "mean_abs_diff": scored.mean_abs_diff,
        "allowed": allowed,
        "margin": allowed - scored.max_abs_diff,
        "floor_max": None if floor is None else floor.max_abs_diff,
        "floor_mean": None if floor is None else floor.mean_abs_diff,
        "passed": bool(scored.max_abs_diff <= allowed),
        "frozen": False,
    }
    if previous is None:
        return check
    moved = np.abs(expected - previous)
    to_previous = float(np.abs(scored.logprobs - previous).mean())
    factor = checker.config.floor_factor
    clear = moved.mean() > factor * floor.mean_abs_diff if floor is not None else moved.max() > allowed
    frozen = bool(clear and to_previous <= scored.mean_abs_diff)
    check |= {"moved_max": float(moved.max()), "moved_mean": float(moved.mean()), "mean_to_previous": to_previous}
    check |= {"frozen": frozen, "passed": check["passed"] and not frozen}
    return check


def failure_message(check: dict, output_dir: Path) -> str:
    """What a failed check says: the version, the differences, what was allowed and where the details are."""
    frozen = (
        f"; inference is closer to the previous version's log-probs (mean {check['mean_to_previous']:.3g}) than to "
        f"this one's, which moved by mean {check['moved_mean']:.3g}: the old policy is still served"
        if check.get("frozen")
        else ""
    )
    floor = (
        ""
        if check.get("floor_max") is None
        else f"; the floor measured on identical weights is {check['floor_max']:.3g} (weight_check.floor_factor)"
    )
    return (
        f"weight update to step {check['step']} did not take effect on inference (policy frozen or corrupted): "
        f"probe log-probs differ by max {check['max_abs_diff']:.3g} (mean {check['mean_abs_diff']:.3g}) over "
        f"{check['num_tokens']} tokens, allowed {check['allowed']:.3g} (orchestrator.weight_check.max_abs_diff{floor})"
        f"{frozen}; details in {RunDir(output_dir).weight_checks_path}"
    )
