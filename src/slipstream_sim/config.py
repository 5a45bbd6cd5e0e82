"""Settings of the simulated inference server and its heavy-tailed per-request latency distribution."""

import math
import random
from statistics import NormalDist
from typing import Literal

from pydantic import Field

from slipstream.config.base import BaseConfig

_Z99 = NormalDist().inv_cdf(0.99)


class SimConfig(BaseConfig):
    """A vLLM stand-in without a model: capacity, latencies, sampling shape and how strict the admin calls are.

    A sequence (one of a request's `n` choices) holds one of `capacity` slots while it decodes; it takes
    `L + num_tokens * token_latency_s` seconds of unpaused time, L drawn from the request-latency distribution,
    and its tokens are spread evenly over that time.
    """

    model_name: str | None = None
    """Served model name; requests naming another model get HTTP 404. None accepts any name."""

    capacity: int = Field(256, ge=1)
    """Most sequences decoded at once (vLLM's max_num_seqs); further sequences queue in arrival order."""

    token_latency_s: float = Field(0.0, ge=0.0)
    """Decode time of each generated token, on top of the request latency."""

    request_latency_p50_s: float = Field(0.0, ge=0.0)
    """Median of the per-sequence latency L (0: no request latency)."""

    request_latency_tail_ratio: float = Field(1.0, ge=1.0)
    """p99 / p50 of L (1: every sequence takes exactly the median)."""

    request_latency_dist: Literal["lognormal", "pareto"] = "lognormal"
    """Shape of L: lognormal, or Pareto (type I, heavier tail beyond p99) with the same p50 and p99."""

    seed: int = 0
    """Seed of sampled tokens (with the prompt, choice index and the request's `seed`) and of latencies."""

    vocab_size: int = Field(1000, ge=2)
    """Sampled token ids are in [0, vocab_size)."""

    default_max_tokens: int = Field(16, ge=1)
    """Completion length when a request sets neither max_completion_tokens nor max_tokens."""

    stop_prob: float = Field(0.0, ge=0.0, lt=1.0)
    """Chance that each token ends its completion (finish_reason "stop"); 0: every completion runs to max tokens."""

    initial_version: int = Field(0, ge=0)
    """Policy version served before the first weight load."""

    require_pause_for_load: bool = True
    """Reject a weight update unless generation is paused (catches a missing /pause in the caller)."""

    require_ready_marker: bool = True
    """Like Slipstream's vLLM engine, reject loading a weights folder without its READY marker."""

    routed_experts_layers: int = Field(0, ge=0)
    """Return routed experts like vLLM's `--enable-return-routed-experts` for an MoE model of this many MoE layers
    (0: off): every chat choice gets `routed_experts`, pseudo-random experts (policy.sim_routing) per token."""

    routed_experts_top_k: int = Field(2, ge=1)
    """Experts per token of the returned routing."""

    routed_experts_num_experts: int = Field(8, ge=1)
    """Experts per MoE layer of the returned routing (ids in [0, this))."""

    transfer_device: str = "cpu"
    """Device broadcast weights are received on (`cuda:0` to receive over NCCL on a GPU)."""


class LatencyModel:
    """Per-sequence latency L with a given median and p99/p50 ratio (lognormal or Pareto type I)."""

    def __init__(self, dist: Literal["lognormal", "pareto"], p50_s: float, tail_ratio: float) -> None:
        if p50_s < 0 or tail_ratio < 1:
            raise ValueError(f"need p50_s >= 0 and tail_ratio >= 1, got p50_s={p50_s}, tail_ratio={tail_ratio}")
        self.dist, self.p50_s, self.tail_ratio = dist, p50_s, tail_ratio
        self.constant = p50_s == 0 or tail_ratio == 1
        if dist == "lognormal":
            # median = exp(mu), p99 = exp(mu + z99 * sigma)
            self.mu, self.sigma = math.log(p50_s) if p50_s > 0 else 0.0, math.log(tail_ratio) / _Z99
        elif dist == "pareto":
            # quantile(q) = x_m * (1 - q) ** (-1 / alpha), so p99 / p50 = 50 ** (1 / alpha)
            self.alpha = math.log(50) / math.log(tail_ratio) if tail_ratio > 1 else math.inf
            self.x_m = p50_s / 2 ** (1 / self.alpha)
        else:
            raise ValueError(f"unknown latency distribution {dist!r}; use 'lognormal' or 'pareto'")

    @classmethod
    def from_config(cls, config: SimConfig) -> "LatencyModel":
        return cls(config.request_latency_dist, config.request_latency_p50_s, config.request_latency_tail_ratio)

    def sample(self, rng: random.Random) -> float:
        if self.constant:
            return self.p50_s
        if self.dist == "lognormal":
            return rng.lognormvariate(self.mu, self.sigma)
        return self.x_m * rng.paretovariate(self.alpha)

    def quantile(self, q: float) -> float:
        """Exact quantile of the distribution (0 < q < 1)."""
        if self.constant:
            return self.p50_s
        if self.dist == "lognormal":
            return math.exp(self.mu + self.sigma * NormalDist().inv_cdf(q))
        return self.x_m * (1 - q) ** (-1 / self.alpha)


def latency_percentiles(config: SimConfig, num_samples: int = 100_000, seed: int = 0) -> dict[str, float]:
    """Empirical p50, p99 and p99/p50 of the configured per-sequence latency L (from `num_samples` draws)."""
    model, rng = LatencyModel.from_config(config), random.Random(seed)
    draws = sorted(model.sample(rng) for _ in range(num_samples))
    p50, p99 = draws[int(0.50 * (num_samples - 1))], draws[int(0.99 * (num_samples - 1))]
    return {"p50_s": p50, "p99_s": p99, "tail_ratio": p99 / p50 if p50 > 0 else math.nan}
