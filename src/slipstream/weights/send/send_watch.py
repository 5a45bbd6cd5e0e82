"""Wait for a version's broadcasts to complete without hanging on a receiver that died.

On CUDA the trainer only queues its broadcasts: NCCL runs them on its own streams, and a receiver that dies in the
middle leaves them waiting for it. NCCL's transports inside a node (NVLink, PCIe) do not notice a dead peer, and the
communicator's watchdog would end the whole trainer process only after the group's timeout. So the trainer waits for
its sends to complete (an event queued after them) while it watches the version's ACCEPT marker: when the
orchestrator accepts the version for another session (it lost inference, and the restarted server's workers wait
for this version), the old group is aborted, which ends its pending broadcasts, and the send is redone for the new
session. Only then is a version marked DELIVERED, so a version whose transfer did not complete stays offered.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slipstream.weights.wire.offers import read_accept


class SessionSuperseded(RuntimeError):
    """The orchestrator accepted the version for another session while this one's sends were pending."""


@dataclass
class SendWatch:
    """Waits for the sends of version `step` in transfer session `session` (see the module docstring)."""

    output_dir: Path
    step: int
    session: str
    timeout_s: float
    poll_s: float = 0.0005
    """How often completion is polled (a CUDA event's query costs about a microsecond)."""
    spin_s: float = 0.0
    """For this long first, completion is polled without sleeping (a sleep of 50 us takes 60-110 us on Linux, which
    the end of a 4 ms send would wait for)."""
    check_every_s: float = 0.1
    """How often the ACCEPT marker is read."""

    def wait(self, done: Callable[[], bool], abort: Callable[[], None]) -> BaseException | None:
        """Poll `done` until it is true (None); if the version is accepted for another session, or `timeout_s`
        passes first, call `abort` (which must end the pending sends) and return the error."""
        start = time.monotonic()
        next_check = start + self.check_every_s
        while not done():
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self.check_every_s
                accept = read_accept(self.output_dir, self.step)
                if accept is not None and accept.session != self.session:
                    abort()
                    return SessionSuperseded(
                        f"inference took the weights of step {self.step} in session {accept.session} while the send "
                        f"to session {self.session} was pending (its receiver was lost)"
                    )
            if now - start > self.timeout_s:
                abort()
                return TimeoutError(
                    f"the weights of step {self.step} were not received within {self.timeout_s:.0f}s of their send "
                    f"(session {self.session}); the receiving vLLM workers may hang"
                )
            time.sleep(self.poll_s if now - start >= self.spin_s else 0)
        return None
