"""Published weights on the filesystem: `weights/step_N/` (HF safetensors + config + probe.json + READY).

A step directory is complete once its READY marker exists; writers build it under a temporary name and
rename it into place (see trainer/weights.py).
"""

import json
from pathlib import Path

from slipstream.rundir import PROBE as PROBE  # re-exported: the run layout lives in rundir.py
from slipstream.rundir import READY as READY
from slipstream.rundir import RunDir


def weights_dir(output_dir: Path, step: int) -> Path:
    return RunDir(output_dir).weights_dir(step)


def is_ready(output_dir: Path, step: int) -> bool:
    return RunDir(output_dir).ready_marker(step).exists()


def latest_ready_step(output_dir: Path) -> int | None:
    """Highest step with complete published weights, or None."""
    return max(RunDir(output_dir).published_steps(), default=None)


def read_probe(output_dir: Path, step: int) -> dict:
    """The trainer's probe for `step`: {"token_ids": [...], "logprobs": [...]} where logprobs[i] is the
    log-prob of token_ids[i + 1] given token_ids[: i + 1], at temperature 1."""
    return json.loads(RunDir(output_dir).probe_path(step).read_text())
