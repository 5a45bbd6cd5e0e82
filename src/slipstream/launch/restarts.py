"""Restarting the inference server when it dies mid-run: a bounded number of times, with a doubling delay, logged
in the launcher's output and in the server's log. The orchestrator notices on its own (orchestrator.recovery)."""

import time
import urllib.error
import urllib.request
from collections.abc import Callable

from slipstream.config.rl import LaunchConfig
from slipstream.launch.supervisor import ChildFailed, Supervisor

INFERENCE = "inference"
MAX_BACKOFF_S = 60.0


class InferenceRestarts:
    """Restart budget of the inference child and what the launcher reports about it."""

    def __init__(self, config: LaunchConfig, health_url: str, say: Callable[[str], None]) -> None:
        self.max_restarts = config.inference_restarts
        self.backoff_s = config.inference_restart_backoff_s
        self.health_url = health_url
        self.say = say
        self.num_restarts = 0
        self._awaiting_health_since: float | None = None

    def handles(self, failure: ChildFailed) -> bool:
        """Whether this death is the inference server's and the budget allows another restart."""
        return failure.name == INFERENCE and self.num_restarts < self.max_restarts

    def delay_s(self) -> float:
        """Delay before the next restart: backoff_s, doubled for each restart already made."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2**self.num_restarts)

    def restart(self, sup: Supervisor, failure: ChildFailed, keep_watching: Callable[[], None]) -> None:
        """Wait the backoff (calling `keep_watching` so other children are still supervised), then restart."""
        delay = self.delay_s()
        self.num_restarts += 1
        self.say(
            f"{failure}; restarting it in {delay:.0f}s (restart {self.num_restarts} of {self.max_restarts}, "
            "launch.inference_restarts); the orchestrator waits for it and reloads the served weights"
        )
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            keep_watching()
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        with open(failure.log_path, "a") as log:
            log.write(f"\n===== slipstream: inference restart {self.num_restarts} of {self.max_restarts} =====\n")
        sup.restart(INFERENCE)
        self._awaiting_health_since = time.monotonic()

    def poll_health(self) -> None:
        """After a restart: report once when the server answers /health again."""
        if self._awaiting_health_since is None:
            return
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as resp:
                healthy = resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            healthy = False
        if healthy:
            seconds = time.monotonic() - self._awaiting_health_since
            self.say(f"inference healthy again {seconds:.0f}s after restart {self.num_restarts}")
            self._awaiting_health_since = None
