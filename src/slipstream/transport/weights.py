"""Published weights on the filesystem: `weights/step_N/` (HF safetensors + config + probe.json + READY).

A step directory is complete once its READY marker exists; writers build it under a temporary name and
rename it into place (see trainer/weights.py).
"""

import json
import re
import time
from pathlib import Path

READY = "READY"
PROBE = "probe.json"
_STEP_RE = re.compile(r"^step_(\d+)$")


def weights_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "weights" / f"step_{step}"


def is_ready(output_dir: Path, step: int) -> bool:
    return (weights_dir(output_dir, step) / READY).exists()


def latest_ready_step(output_dir: Path) -> int | None:
    """Highest step with complete published weights, or None."""
    root = Path(output_dir) / "weights"
    if not root.is_dir():
        return None
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and (p / READY).exists()]
    return max(steps, default=None)


def wait_for_weights(output_dir: Path, min_step: int, timeout_s: float, poll_s: float = 0.05) -> int:
    """Block until weights of a step >= `min_step` are ready; return the newest such step."""
    deadline = time.monotonic() + timeout_s
    while True:
        step = latest_ready_step(output_dir)
        if step is not None and step >= min_step:
            return step
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f}s for the trainer to publish {weights_dir(output_dir, min_step)}; "
                "is the trainer running?"
            )
        time.sleep(poll_s)


def read_probe(output_dir: Path, step: int) -> dict:
    """The trainer's probe for `step`: {"token_ids": [...], "logprobs": [...]} where logprobs[i] is the
    log-prob of token_ids[i + 1] given token_ids[: i + 1], at temperature 1."""
    return json.loads((weights_dir(output_dir, step) / PROBE).read_text())
