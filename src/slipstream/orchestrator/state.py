"""The orchestrator's part of a whole-run checkpoint (`checkpoints/step_N/orchestrator/`): where the task stream
stood once batch N was assembled, the pipeline's cumulative counters, and what a resumed run must agree with.

Groups in flight or buffered when batch N was taken are not saved: a resumed run generates their tasks again
(first, by stream position) with the resumed policy. Task sampling depends only on (seed, position), and with
`seed_requests` so do the samples, so a resumed run's data is determined by the seed and this state (with
max_async_level = 0 it equals the uninterrupted run's).
"""

import shutil
from pathlib import Path

import msgspec

from slipstream.rundir import COMMITTED, ORCHESTRATOR_PART, RunDir
from slipstream.utils.fs import atomic_write_bytes, atomic_write_text, commit_dir

STATE_FORMAT_VERSION = 1
STATE_FILE = "state.json"


class OrchestratorState(msgspec.Struct, frozen=True):
    """The orchestrator after batch `step` was assembled."""

    step: int
    """Batches written so far; a resumed run writes batch step + 1 next."""
    seed: int
    env_name: str
    tasks_per_step: int
    next_task_index: int
    """First stream position no group was dispatched for."""
    requeued_task_indices: list[int]
    """Positions dispatched but not in batches 1..step (in flight or buffered then): generated again at resume."""
    num_dispatched: int
    num_cancelled: int
    num_dropped: int
    num_failed: int
    num_abandoned: int
    failed_rollouts_by_stage: dict[str, int]
    format_version: int = STATE_FORMAT_VERSION


def save_state(output_dir: Path, state: OrchestratorState) -> Path:
    """Write and commit `checkpoints/step_N/orchestrator/` (state + COMMITTED, renamed into place)."""
    run = RunDir(output_dir)
    final_dir = run.checkpoint_part_dir(state.step, ORCHESTRATOR_PART)
    tmp_dir = run.checkpoint_part_tmp_dir(state.step, ORCHESTRATOR_PART)
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)  # left by an orchestrator that died while checkpointing
    atomic_write_bytes(tmp_dir / STATE_FILE, msgspec.json.format(msgspec.json.encode(state)) + b"\n")
    atomic_write_text(tmp_dir / COMMITTED, f"{state.step}\n")
    commit_dir(tmp_dir, final_dir)
    return final_dir


def load_state(output_dir: Path, step: int, seed: int, env_name: str, tasks_per_step: int) -> OrchestratorState:
    """Read the committed state of `step`; raise naming the field when the run's config does not match it."""
    path = RunDir(output_dir).checkpoint_part_dir(step, ORCHESTRATOR_PART) / STATE_FILE
    try:
        state = msgspec.json.decode(path.read_bytes(), type=OrchestratorState)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{path}: not a valid orchestrator state: {e}") from e
    if state.format_version != STATE_FORMAT_VERSION or state.step != step:
        raise ValueError(
            f"{path}: format {state.format_version} of step {state.step}, expected format {STATE_FORMAT_VERSION} of "
            f"step {step}; resume with the Slipstream version that wrote it"
        )
    for field, saved, now in (
        ("seed", state.seed, seed),
        ("orchestrator.env.name", state.env_name, env_name),
        ("orchestrator.batch_size / orchestrator.group_size (tasks per step)", state.tasks_per_step, tasks_per_step),
    ):
        if saved != now:
            raise ValueError(
                f"{path} was written with {field} = {saved!r} but this run has {now!r}; resume with the config of the "
                f"original run ({RunDir(output_dir).config_path('rl')})"
            )
    return state
