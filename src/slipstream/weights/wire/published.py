"""Published weights on the filesystem: `weights/step_N/` (HF safetensors + config + probe.json + READY).

A step directory is complete once its READY marker exists; writers build it under a temporary name and
rename it into place (see weights/send/folder.py).
"""

import json
import math
from pathlib import Path

from slipstream.rundir import PROBE as PROBE  # re-exported: the run layout lives in rundir.py
from slipstream.rundir import READY as READY
from slipstream.rundir import RunDir

INCOMPLETE_MARKER = "weight update incomplete"
"""In the error of a version the engine received but did not load whole (weights/receive/receiver.check_loaded); the
orchestrator tells it from a lost server by this text in vLLM's HTTP 500 reply (orchestrator/client.py)."""
STAGING_FAILED = "weight staging failed"
"""In the error of a no-stall update whose version could not be staged (weights/receive/staging.py), told apart the
same way."""


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
    path = RunDir(output_dir).probe_path(step)
    probe = read_marker(path, {"token_ids": list, "logprobs": list})
    token_ids, logprobs = probe["token_ids"], probe["logprobs"]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
        raise ValueError(f"{path}: 'token_ids' must be token ids (integers >= 0)")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in logprobs):
        raise ValueError(f"{path}: 'logprobs' must be finite numbers")
    if len(logprobs) != len(token_ids) - 1 or not logprobs:
        raise ValueError(f"{path}: needs len(logprobs) == len(token_ids) - 1 > 0")
    return probe


def read_marker(path: Path, fields: dict[str, type]) -> dict:
    """A JSON-object marker file with these typed fields; ValueError naming the file and the field otherwise."""
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep
        raise ValueError(f"{path}: not a JSON object ({e}); was it written by another program?") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {data!r:.200}")
    for name, kind in fields.items():
        value = data.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{path}: field {name!r} must be a {kind.__name__}, got {value!r:.200}")
    return data
