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
import shutil
from pathlib import Path

from slipstream.rundir import (
    COMMITTED,
    METRICS_FILE,
    ONLINE_EVAL_FILE,
    ORCHESTRATOR_PART,
    TRAINER_PART,
    WEIGHT_CHECKS_FILE,
    RunDir,
    remove_tree,
    step_dirs,
)
from slipstream.utils.fs import atomic_write_text

STEP_LOGS = {METRICS_FILE: 0, WEIGHT_CHECKS_FILE: -1, ONLINE_EVAL_FILE: -1}
"""JSON-lines files with one record per step or policy version (key `step`) -> offset: at resume from step K the
records of steps <= K + offset are kept. A resumed orchestrator loads (and verifies) the policy of step K again, and
its online evaluation starts with it, so their old records of K go too."""


def is_checkpoint_step(step: int, interval: int | None, max_steps: int) -> bool:
    """Whether `step` is checkpointed: every `interval` steps and the last step (never when interval is 0 or None)."""
    return bool(interval) and (step % interval == 0 or step == max_steps)


def resume_weight_steps(committed: list[int], published: list[int], interval: int | None, max_steps: int) -> set[int]:
    """Published weight steps a resume may need (inference is given the resumed step's weights): the committed
    checkpoints, and checkpoint steps newer than the newest committed one (their commit may still come)."""
    newest = max(committed, default=0)
    later = {s for s in published if s > newest and is_checkpoint_step(s, interval, max_steps)}
    return set(committed) | later


def step_dir(output_dir: Path, step: int) -> Path:
    return RunDir(output_dir).checkpoint_dir(step)


def part_dir(output_dir: Path, step: int, part: str) -> Path:
    return RunDir(output_dir).checkpoint_part_dir(step, part)


def checkpoint_steps(output_dir: Path) -> list[int]:
    """Steps with a checkpoint folder (committed or not), ascending."""
    return sorted(step_dirs(RunDir(output_dir).checkpoints_root))


def committed_run_steps(output_dir: Path) -> list[int]:
    """Steps whose whole-run checkpoint is committed (`step_N/COMMITTED`), ascending."""
    return RunDir(output_dir).committed_checkpoint_steps()


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
    marker = RunDir(output_dir).checkpoint_marker(step)
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


def prepare_resume(output_dir: Path, step: int) -> list[str]:
    """Make the run directory look as it did right after step `step` was committed (0: before any step): delete
    rollouts, weights and checkpoints of later steps (and uncommitted checkpoints), drop later records from the
    per-step logs (STEP_LOGS). Run while no process of the run is alive. Returns a description of what was removed."""
    run = RunDir(output_dir)
    removed: list[str] = []
    for root in (run.rollouts_root, run.weights_root, run.checkpoints_root):
        plane = root.name
        for s, path in sorted(step_dirs(root).items()):
            uncommitted = root == run.checkpoints_root and not (path / COMMITTED).is_file()
            if s > step or uncommitted:
                remove_tree(path)
                removed.append(f"{plane}/{path.name}")
        if root.is_dir():  # temporary folders of writers that died mid-write
            for path in root.iterdir():
                if path.is_dir() and path.name.startswith("."):
                    shutil.rmtree(path)
                    removed.append(f"{plane}/{path.name}")
    for name, offset in STEP_LOGS.items():
        dropped = truncate_step_log(run.root / name, step + offset)
        if dropped:
            removed.append(f"{dropped} record(s) of {name}")
    return removed


def truncate_step_log(path: Path, step: int) -> int:
    """Keep the records of steps <= `step` in a JSON-lines file (rewritten atomically); return how many were
    dropped. A torn last line (the writer died mid-append) is dropped too."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # torn, or not text
            dropped += 1
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int | float):
            raise ValueError(
                f"{path}:{number}: a record without a numeric 'step' ({line[:200]!r}); only Slipstream writes this "
                "file: remove that line to resume"
            )
        if record["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return dropped
