"""Inputs and outputs of the pipeline simulation: the orchestrator's scheduling settings, the inference server's
capacity and latencies, the trainer's step time and the fixed costs between them."""

from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig
from slipstream.planner.distributions import TailDist, constant


class PipelineSimConfig(BaseConfig):
    """One simulated run: `num_steps` training steps of the real orchestrator rules against a simulated server."""

    num_steps: int = Field(ge=1)
    """Training steps to simulate."""

    batch_size: int = Field(ge=1)
    """Rollouts per step (orchestrator.batch_size)."""

    group_size: int = Field(ge=1)
    """Rollouts per task (orchestrator.group_size)."""

    max_async_level: int = Field(ge=0)
    """orchestrator.max_async_level: batch n needs policy >= n - 1 - max_async_level."""

    max_off_policy_steps: int = Field(8, ge=0)
    """orchestrator.max_off_policy_steps: older groups are cancelled in flight or dropped."""

    spare_batches: int = Field(1, ge=0)
    """orchestrator.spare_batches (used with max_async_level >= 1 while the trainer waits)."""

    in_flight_limit: int = Field(ge=1)
    """Completions in flight at most (orchestrator.concurrency.max in fixed mode)."""

    version_tracking: Literal["stream", "reply"] = "stream"
    """stream: requests are streamed, so the tokens of a group in flight are seen as they come (the orchestrator's
    default); reply: whole replies, a group in flight counts as old as its request (router replay)."""

    capacity: int = Field(ge=1)
    """Sequences the inference deployment decodes at once (over all replicas); more wait in a queue."""

    sequence_latency: TailDist = constant(0.0)
    """Per-sequence latency in seconds on top of its tokens (prefill, or the simulator's request latency)."""

    completion_tokens: TailDist = constant(16.0)
    """Tokens generated per model turn."""

    token_latency_s: float = Field(0.0, ge=0.0)
    """Decode time per generated token of one sequence at full load."""

    num_turns: int = Field(1, ge=1)
    """Model turns per rollout (1: single-turn)."""

    env_latency: TailDist = constant(0.0)
    """Environment (tool) time between two model turns, seconds."""

    train_step_s: float = Field(ge=0.0)
    """Trainer time per step, from batch in hand to weights published."""

    weight_update_s: float = Field(0.0, ge=0.0)
    """Inference frozen per weight update (pause, load, resume)."""

    weight_check_s: float = Field(0.0, ge=0.0)
    """Fixed cost of the probe check after the resume, on top of its one-token request, which queues for a decode
    slot like any other; new requests wait until the check is done."""

    weights_poll_s: float = Field(0.1, gt=0.0)
    """orchestrator.weights_poll_s: how often newly published weights are looked for."""

    weights_poll_jitter_s: float = Field(0.0, ge=0.0)
    """Extra time per poll, uniform in [0, this] (the real poll's thread hop and timer delays): it keeps the poll
    from locking onto the step period, which a perfectly periodic poll would."""

    batch_write_s: float = Field(0.0, ge=0.0)
    """Orchestrator time per batch (advantages, packing, writing); nothing else runs meanwhile."""

    request_overhead_s: float = Field(0.0, ge=0.0)
    """Fixed time from sending a request to the server starting it (network round trip)."""

    request_cost_s: float = Field(0.0, ge=0.0)
    """Orchestrator CPU per request (building, sending, parsing and scoring it), spent one request at a time: a
    burst of n requests reaches the server over n x this."""

    trainer_poll_s: float = Field(0.0, ge=0.0)
    """How often the trainer looks for its next batch (half of it is the mean delay)."""

    startup_s: float = Field(0.0, ge=0.0)
    """Time before the first rollout starts, counted in steps/hour."""

    seed: int = 0
    """Seed of the sampled latencies and lengths."""

    @model_validator(mode="after")
    def _check(self) -> "PipelineSimConfig":
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size}); change either"
            )
        if self.max_off_policy_steps < self.max_async_level:
            raise ValueError(
                f"max_off_policy_steps ({self.max_off_policy_steps}) is below max_async_level ({self.max_async_level}): "
                "rollouts of the oldest policy a batch may use would be dropped; raise max_off_policy_steps"
            )
        return self


@dataclass
class PipelineSimResult:
    """What one simulated run measured (the same quantities benchmarks/async_vs_sync.py reports)."""

    steps_per_hour: float
    seconds: float
    lag_mean: float
    """Mean over steps of each batch's mean token lag ((step - 1) - token version)."""
    lag_max: int
    lag_hist: dict[int, int]
    """Tokens trained per lag (steps), over the whole run."""
    multi_version: float
    """Share of rollouts whose tokens span a weight update."""
    num_dispatched: int
    num_cancelled: int
    num_dropped: int
    trainer_idle: float
    """Share of the run the trainer waited for batches (high: inference is the bottleneck)."""
    inference_busy: float
    """Mean share of decode slots busy over the run (frozen time counts as idle)."""
    mean_decoding: float
    """Mean sequences decoding while inference is not frozen (the decode batch it actually runs)."""
    rollout_latency_p50_s: float
    rollout_latency_p99_s: float
    """Group latency from dispatch to its last rollout's end."""
    step_s: list[float] = field(default_factory=list)
    """Time between consecutive published steps."""

    @property
    def bottleneck(self) -> Literal["trainer", "inference", "latency"]:
        """trainer: busy nearly all the time (< 15% idle); otherwise the trainer waits for rollouts, either because
        inference is busy (>= half its slots decoding on average: throughput) or not (latency: the rollouts' tail,
        synchronous waits, weight-update pauses)."""
        if self.trainer_idle < 0.15:
            return "trainer"
        return "inference" if self.inference_busy >= 0.5 else "latency"
