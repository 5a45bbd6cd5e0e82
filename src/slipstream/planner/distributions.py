"""Heavy-tailed distributions the planner samples from (sequence latency, completion and prompt lengths), each
given by its median and p99/p50 ratio, the two figures users and benchmarks quote."""

import math
import random
from statistics import NormalDist
from typing import Literal

from pydantic import Field

from slipstream.config.base import BaseConfig

_Z99 = NormalDist().inv_cdf(0.99)


class TailDist(BaseConfig):
    """A positive quantity with median `p50` and p99 = `tail_ratio` x p50: lognormal, or Pareto type I (heavier
    beyond p99) with the same two quantiles. `tail_ratio = 1` is a constant."""

    p50: float = Field(ge=0.0)
    """Median."""

    tail_ratio: float = Field(1.0, ge=1.0)
    """p99 / p50 (1: always the median)."""

    kind: Literal["lognormal", "pareto"] = "lognormal"
    """Shape of the tail."""

    max: float | None = Field(None, gt=0.0)
    """Upper clip (a token budget such as max_tokens); None: unclipped."""

    @property
    def constant(self) -> bool:
        return self.p50 == 0 or self.tail_ratio == 1

    def sample(self, rng: random.Random) -> float:
        if self.constant:
            value = self.p50
        elif self.kind == "lognormal":
            value = rng.lognormvariate(math.log(self.p50), math.log(self.tail_ratio) / _Z99)
        else:
            alpha = math.log(50) / math.log(self.tail_ratio)
            value = self.p50 / 2 ** (1 / alpha) * rng.paretovariate(alpha)
        return value if self.max is None else min(value, self.max)

    def quantile(self, q: float) -> float:
        """Exact quantile (0 < q < 1), clipped at `max`."""
        if self.constant:
            value = self.p50
        elif self.kind == "lognormal":
            sigma = math.log(self.tail_ratio) / _Z99
            value = math.exp(math.log(self.p50) + sigma * NormalDist().inv_cdf(q))
        else:
            alpha = math.log(50) / math.log(self.tail_ratio)
            value = self.p50 / 2 ** (1 / alpha) * (1 - q) ** (-1 / alpha)
        return value if self.max is None else min(value, self.max)

    def mean(self, num_samples: int = 20_000, seed: int = 0) -> float:
        """Mean (by sampling: exact for the clipped and Pareto cases alike)."""
        rng = random.Random(seed)
        return sum(self.sample(rng) for _ in range(num_samples)) / num_samples


def constant(value: float) -> TailDist:
    return TailDist(p50=value, tail_ratio=1.0)
