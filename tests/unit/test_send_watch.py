"""weights/send/send_watch.py: the trainer waits for its broadcasts to complete, and aborts them when the orchestrator
takes the version in another session (a restarted inference server) or when they never complete."""

import time

from slipstream.weights.send.send_watch import SendWatch, SessionSuperseded
from slipstream.weights.wire.offers import Accept, write_accept
from slipstream.weights.wire.published import weights_dir


def _accepted(tmp_path, session: str):
    weights_dir(tmp_path, 3).mkdir(parents=True, exist_ok=True)
    write_accept(tmp_path, 3, Accept(session, 2))


def test_completed_sends_return_without_aborting(tmp_path):
    _accepted(tmp_path, "s1")
    polls, aborted = [], []

    def done() -> bool:
        polls.append(1)
        return len(polls) >= 5

    assert SendWatch(tmp_path, 3, "s1", timeout_s=10).wait(done, lambda: aborted.append(1)) is None
    assert len(polls) == 5 and not aborted


def test_a_version_accepted_for_another_session_aborts_the_pending_sends(tmp_path):
    _accepted(tmp_path, "s1")
    aborted: list[float] = []
    start = time.monotonic()

    def done() -> bool:
        if time.monotonic() - start > 0.05 and not (tmp_path / "moved").exists():
            _accepted(tmp_path, "s2")  # the orchestrator restarted inference and accepts for the new session
            (tmp_path / "moved").touch()
        return bool(aborted)  # the sends end only when aborted (what a dead receiver leaves)

    watch = SendWatch(tmp_path, 3, "s1", timeout_s=30, check_every_s=0.01)
    error = watch.wait(done, lambda: aborted.append(time.monotonic()))
    assert isinstance(error, SessionSuperseded) and "session s2" in str(error) and "session s1" in str(error)
    assert len(aborted) == 1 and aborted[0] - start < 5


def test_the_same_session_keeps_waiting_until_the_timeout(tmp_path):
    _accepted(tmp_path, "s1")
    aborted = []
    watch = SendWatch(tmp_path, 3, "s1", timeout_s=0.2, check_every_s=0.01)
    start = time.monotonic()
    error = watch.wait(lambda: False, lambda: aborted.append(1))
    assert isinstance(error, TimeoutError) and "step 3" in str(error)
    assert aborted == [1] and time.monotonic() - start >= 0.2


class _Clock:
    """time for send_watch: monotonic() advances only by what sleep() is asked for (plus 1 us per poll)."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_completion_is_polled_without_sleeping_for_spin_s_then_every_poll_s(tmp_path, monkeypatch):
    import slipstream.weights.send.send_watch as send_watch

    clock = _Clock()
    monkeypatch.setattr(send_watch, "time", clock)
    _accepted(tmp_path, "s1")
    polls: list[int] = []

    def done() -> bool:
        polls.append(1)
        return clock.now > 0.003 + 0.0005 * 4  # 3 ms of spinning, then four sleeps of 0.5 ms

    watch = SendWatch(tmp_path, 3, "s1", timeout_s=10, poll_s=0.0005, spin_s=0.003)
    assert watch.wait(done, lambda: None) is None
    spins = [s for s in clock.sleeps if s == 0]
    assert len(spins) > 100 and clock.sleeps[: len(spins)] == spins  # spinning first: ~1 us a poll
    assert clock.sleeps[len(spins) :] == [0.0005] * (len(clock.sleeps) - len(spins))
    assert 4 <= len(clock.sleeps) - len(spins) <= 5
