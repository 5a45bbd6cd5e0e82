"""Hand-over of one weight version by broadcast, through markers in its `weights/step_N/` folder (torch-free):
the trainer OFFERs it (manifest.json + probe.json + OFFER), the orchestrator ACCEPTs it for a session of the
receiving side (ACCEPT: session id and group size), the trainer broadcasts and marks it DELIVERED.

The trainer keeps offering a version until one session receives it whole: if inference dies mid-transfer, the
orchestrator accepts it again for the restarted server's new session.
"""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from slipstream.utils.fs import atomic_write_text
from slipstream.weights.wire.published import read_marker, weights_dir

OFFER = "OFFER"
ACCEPT = "ACCEPT"
DELIVERED = "DELIVERED"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Accept:
    """The orchestrator's answer to an offer: receive it in this session, with this many ranks in the group."""

    session: str
    world_size: int


def is_offered(output_dir: Path, step: int) -> bool:
    return (weights_dir(output_dir, step) / OFFER).exists()


def is_delivered(output_dir: Path, step: int) -> bool:
    return (weights_dir(output_dir, step) / DELIVERED).exists()


def latest_offered_step(output_dir: Path) -> int | None:
    """Newest step whose weights are offered for broadcast, or None."""
    from slipstream.rundir import RunDir, step_dirs

    steps = [s for s, path in step_dirs(RunDir(output_dir).weights_root).items() if (path / OFFER).exists()]
    return max(steps, default=None)


def read_manifest(output_dir: Path, step: int) -> dict:
    """The broadcast's manifest (stream.Manifest.to_dict; validated by the receiver)."""
    return read_marker(weights_dir(output_dir, step) / MANIFEST, {"version": int, "step": int, "buckets": list})


def write_accept(output_dir: Path, step: int, accept: Accept) -> None:
    atomic_write_text(weights_dir(output_dir, step) / ACCEPT, json.dumps(asdict(accept)))


def read_accept(output_dir: Path, step: int) -> Accept | None:
    path = weights_dir(output_dir, step) / ACCEPT
    try:
        data = read_marker(path, {"session": str, "world_size": int})
    except FileNotFoundError:
        return None
    return Accept(data["session"], data["world_size"])


def mark_delivered(output_dir: Path, step: int, session: str) -> None:
    atomic_write_text(weights_dir(output_dir, step) / DELIVERED, json.dumps({"session": session}))


def wait_for_accept(output_dir: Path, step: int, refused: set[str], timeout_s: float, poll_s: float = 0.05) -> Accept:
    """Block until the orchestrator accepts `step` for a session not in `refused` (sessions that failed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        accept = read_accept(output_dir, step)
        if accept is not None and accept.session not in refused:
            return accept
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f}s for the orchestrator to accept the weights of step {step} "
                f"({weights_dir(output_dir, step) / ACCEPT}); is the orchestrator running, and does it use the same "
                "weights.transport? Raise weights.accept_timeout_s if online evaluations hold updates longer"
            )
        time.sleep(poll_s)


def wait_delivered(output_dir: Path, step: int, timeout_s: float, poll_s: float = 0.01) -> None:
    """Block until version `step` is marked DELIVERED (the ipc transport: inference copied it out of the trainer's
    buffer, which may then take the next version)."""
    deadline = time.monotonic() + timeout_s
    while not is_delivered(output_dir, step):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f}s for inference to take the weights of step {step} from the trainer's shared "
                f"memory ({weights_dir(output_dir, step) / DELIVERED}); is the orchestrator running, and does it use "
                "the same weights.transport? Raise weights.accept_timeout_s if online evaluations hold updates longer"
            )
        time.sleep(poll_s)


def latest_available_step(output_dir: Path) -> int | None:
    """Newest version inference can be given now: complete on disk (READY), or offered by broadcast and not yet
    delivered (the trainer is waiting to send it)."""
    from slipstream.weights.wire.published import latest_ready_step

    ready = latest_ready_step(output_dir)
    offered = latest_offered_step(output_dir)
    if offered is not None and is_delivered(output_dir, offered):
        offered = None
    return max((s for s in (ready, offered) if s is not None), default=None)


def wait_for_available(output_dir: Path, min_step: int, timeout_s: float, poll_s: float = 0.05) -> int:
    """Block until a version >= `min_step` is available (see latest_available_step); return the newest."""
    deadline = time.monotonic() + timeout_s
    while True:
        step = latest_available_step(output_dir)
        if step is not None and step >= min_step:
            return step
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f}s for the trainer to publish the weights of step {min_step} "
                f"({weights_dir(output_dir, min_step)}); is the trainer running?"
            )
        time.sleep(poll_s)


def read_offer(output_dir: Path, step: int) -> dict:
    """The trainer's offer of `step`: {"step", "backend", "senders"} (senders: how many trainer ranks send, ranks
    0 .. senders - 1 of the transfer group; 1 when absent)."""
    path = weights_dir(output_dir, step) / OFFER
    data = read_marker(path, {"step": int, "backend": str})
    senders = data.setdefault("senders", 1)
    if not isinstance(senders, int) or isinstance(senders, bool) or senders < 1:
        raise ValueError(f"{path}: field 'senders' must be an integer >= 1, got {senders!r:.200}")
    return data
