"""Whole-run checkpoints on the filesystem (torch-free): `checkpoints/step_N/{trainer,orchestrator}/` and the step's
COMMITTED marker, retention, and preparing a run directory to resume from a step.

Commit protocol of step N (a checkpoint step: every `checkpoint.interval` steps and the last step):
1. The orchestrator, right after assembling batch N and before writing `rollouts/step_N/`, writes its state into
   `step_N/.orchestrator.tmp/` (state + COMMITTED) and renames it to `step_N/orchestrator/`.
2. The trainer trains step N, publishes `weights/step_N`, appends step N to metrics.jsonl, then writes its DCP
   checkpoint into `step_N/.trainer.tmp/` and renames it to `step_N/trainer/` (trainer/ckpt.py).
3. Trainer rank 0 checks that both parts are committed (the orchestrator's is, since it precedes the batch the
   trainer trained on) and writes `step_N/COMMITTED`. Only steps with that marker are resumed from or retained.
A crash anywhere before 3 leaves step N uncommitted: resume ignores it and deletes it.
"""

import json
import re
import shutil
from pathlib import Path

from slipstream.utils.fs import atomic_write_text, fsync_dir

COMMITTED = "COMMITTED"
TRAINER_PART = "trainer"
ORCHESTRATOR_PART = "orchestrator"
_STEP_RE = re.compile(r"^step_(\d+)$")
STEP_LOGS = {"metrics.jsonl": 0, "weight_checks.jsonl": -1, "eval/online.jsonl": -1}
"""JSON-lines files with one record per step or policy version (key `step`) -> offset: at resume from step K the
records of steps <= K + offset are kept. A resumed orchestrator loads (and verifies) the policy of step K again, and
its online evaluation starts with it, so their old records of K go too."""


def is_checkpoint_step(step: int, interval: int | None, max_steps: int) -> bool:
    """Whether `step` is checkpointed: every `interval` steps and the last step (never when interval is None)."""
    return interval is not None and (step % interval == 0 or step == max_steps)


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def part_dir(output_dir: Path, step: int, part: str) -> Path:
    return step_dir(output_dir, step) / part


def step_dirs(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()}


def checkpoint_steps(output_dir: Path) -> list[int]:
    """Steps with a checkpoint folder (committed or not), ascending."""
    return sorted(step_dirs(Path(output_dir) / "checkpoints"))


def committed_run_steps(output_dir: Path) -> list[int]:
    """Steps whose whole-run checkpoint is committed (`step_N/COMMITTED`), ascending."""
    return [s for s in checkpoint_steps(output_dir) if (step_dir(output_dir, s) / COMMITTED).is_file()]


def is_part_committed(output_dir: Path, step: int, part: str) -> bool:
    return (part_dir(output_dir, step, part) / COMMITTED).is_file()


def commit_step(output_dir: Path, step: int) -> Path:
    """Write `step_N/COMMITTED` once both parts are committed; raise naming the missing part otherwise."""
    missing = [p for p in (TRAINER_PART, ORCHESTRATOR_PART) if not is_part_committed(output_dir, step, p)]
    if missing:
        raise FileNotFoundError(
            f"cannot commit checkpoint {step_dir(output_dir, step)}: its {' and '.join(missing)} part is not "
            "committed. The orchestrator writes its part before the step's batch, so both processes must use the "
            "same checkpoint.interval and max_steps (set them once at the top level of `slipstream rl`)"
        )
    marker = step_dir(output_dir, step) / COMMITTED
    atomic_write_text(marker, f"{step}\n")
    return marker


def resolve_run_step(output_dir: Path, resume_step: int | str | None, field: str) -> int | None:
    """The committed step to resume from for `resume_step` (an int, "latest" or None); None: start from scratch.
    `field` names the config field in errors."""
    if resume_step is None:
        return None
    steps = committed_run_steps(output_dir)
    if resume_step == "latest":
        return steps[-1] if steps else None
    if resume_step not in steps:
        raise FileNotFoundError(
            f"{field} = {resume_step} but {step_dir(output_dir, int(resume_step))} is not a committed checkpoint "
            f"(committed steps: {steps or 'none'}); pick one of those, or resume from the latest"
        )
    return int(resume_step)


def retained_steps(committed: list[int], keep_last: int | None, keep_every: int | None) -> set[int]:
    """Committed steps to keep: the newest `keep_last` (all when None), steps divisible by `keep_every`, and always
    the newest one."""
    if keep_last is None:
        return set(committed)
    keep = set(committed[-keep_last:]) | set(committed[-1:])
    if keep_every is not None:
        keep |= {s for s in committed if s % keep_every == 0}
    return keep


def prune_checkpoints(
    output_dir: Path, committed: list[int], keep_last: int | None, keep_every: int | None
) -> list[int]:
    """Delete `committed` checkpoints (ascending) outside the retention policy, and checkpoint folders of other steps
    older than the newest committed one (left by crashes; a checkpoint being written is always newer). Returns the
    deleted steps."""
    if not committed:
        return []
    keep = retained_steps(committed, keep_last, keep_every)
    doomed = [s for s in checkpoint_steps(output_dir) if s < committed[-1] and s not in keep]
    for step in doomed:
        remove_tree(step_dir(output_dir, step))
    return doomed


def remove_tree(path: Path) -> None:
    """Delete a folder so that no half-deleted copy is ever seen under its name: rename it away first."""
    doomed = path.with_name(f".deleting_{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    path.rename(doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)


def prepare_resume(output_dir: Path, step: int) -> list[str]:
    """Make the run directory look as it did right after step `step` was committed (0: before any step): delete
    rollouts, weights and checkpoints of later steps (and uncommitted checkpoints), drop later records from the
    per-step logs (STEP_LOGS). Run while no process of the run is alive. Returns a description of what was removed."""
    out = Path(output_dir)
    removed: list[str] = []
    for plane in ("rollouts", "weights", "checkpoints"):
        root = out / plane
        for s, path in sorted(step_dirs(root).items()):
            uncommitted = plane == "checkpoints" and not (path / COMMITTED).is_file()
            if s > step or uncommitted:
                remove_tree(path)
                removed.append(f"{plane}/{path.name}")
        if root.is_dir():  # temporary folders of writers that died mid-write
            for path in root.iterdir():
                if path.is_dir() and path.name.startswith("."):
                    shutil.rmtree(path)
                    removed.append(f"{plane}/{path.name}")
    for name, offset in STEP_LOGS.items():
        dropped = truncate_step_log(out / name, step + offset)
        if dropped:
            removed.append(f"{dropped} record(s) of {name}")
    return removed


def truncate_step_log(path: Path, step: int) -> int:
    """Keep the records of steps <= `step` in a JSON-lines file (rewritten atomically); return how many were
    dropped. A torn last line (the writer died mid-append) is dropped too."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if record["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return dropped
