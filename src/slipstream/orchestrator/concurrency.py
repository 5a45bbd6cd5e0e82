"""In-flight concurrency: a fixed cap, or additive-increase / multiplicative-decrease driven by vLLM's /metrics
(queueing: `vllm:num_requests_waiting`; preemption: `vllm:num_preemptions_total`)."""

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from slipstream.config.orchestrator import ConcurrencyConfig
from slipstream.rollout.client import InferenceError

WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class ServerLoad:
    """What one /metrics read says about the server (summed over engines)."""

    num_waiting: float
    num_preemptions: float | None
    """Cumulative preemptions; None if the server does not export the counter (the simulator)."""


def parse_server_load(text: str, where: str) -> ServerLoad:
    """Sum the waiting gauge and the preemption counter over all label sets of a Prometheus text exposition
    (parsed by prometheus_client's own parser)."""
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (WAITING, PREEMPTIONS):
                    sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    except ValueError as e:
        raise InferenceError(f"{where} returned metrics that are not a Prometheus text exposition: {e}") from e
    if WAITING not in sums:
        raise InferenceError(
            f"{where} has no {WAITING} gauge, so adaptive concurrency cannot see queueing; is it a vLLM server? "
            "Set orchestrator.concurrency.mode = 'fixed' otherwise"
        )
    return ServerLoad(num_waiting=sums[WAITING], num_preemptions=sums.get(PREEMPTIONS))


class InFlightLimit:
    """The in-flight limit in completions: fixed at `max`, or (adaptive) updated once per /metrics poll (see
    ConcurrencyConfig)."""

    def __init__(self, config: ConcurrencyConfig) -> None:
        self.config = config
        self.limit = config.min if config.mode == "adaptive" else config.max
        self.slow_start = True
        self.num_backoffs = 0
        self._waiting_streak = 0
        self._last_preemptions: float | None = None

    def observe(self, load: ServerLoad, saturated: bool, in_flight: int) -> int:
        """Take one poll and return the new limit.

        `saturated`: the limit held rollouts back since the previous poll. `in_flight`: completions in flight now;
        while it is above the limit (after a back-off) the queue holds our own excess, already being shed, so
        pressure then does not back off again.
        """
        c = self.config
        preempted = (
            load.num_preemptions is not None
            and self._last_preemptions is not None
            and load.num_preemptions > self._last_preemptions
        )
        if load.num_preemptions is not None:
            self._last_preemptions = load.num_preemptions
        shedding = in_flight > self.limit
        self._waiting_streak = self._waiting_streak + 1 if load.num_waiting > 0 and not shedding else 0
        if (preempted and not shedding) or self._waiting_streak >= c.waiting_polls:
            self.limit = max(c.min, int(self.limit * c.backoff_factor))
            self.slow_start = False
            self.num_backoffs += 1
            self._waiting_streak = 0
        elif saturated and load.num_waiting == 0:
            grown = self.limit * 2 if self.slow_start else self.limit + c.increase
            self.limit = min(c.max, grown)
        return self.limit
