"""Trainer checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, progress and RNG of step N in
`output_dir/checkpoints/step_N/trainer/`, loadable at any number of ranks (DCP reshards on load).

Commit protocol: every rank writes into `step_N/.trainer.tmp`; after a barrier rank 0 writes progress.json and
the COMMITTED marker there and renames the folder to `step_N/trainer`. Only folders with the marker are loaded.
Under `slipstream rl` the step is then committed as a whole with the orchestrator's part (transport/checkpoints.py).
All ranks must see output_dir on one shared filesystem.
"""

import json
import logging
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from slipstream.parallel.dist import RankInfo, barrier
from slipstream.rundir import COMMITTED, TRAINER_PART, RunDir, step_dirs
from slipstream.transport.checkpoints import committed_run_steps
from slipstream.utils.fs import atomic_write_text, commit_dir
from slipstream.weights.wire.published import read_marker

log = logging.getLogger(__name__)

CKPT_FORMAT_VERSION = 1
PROGRESS = "progress.json"
STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
"""Frozen parameters are not saved: with LoRA (model.lora) a checkpoint holds the adapters and their optimizer
state only, the base weights come from model.name again on resume. Without LoRA nothing is frozen."""
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading leaves the frozen parameters as they are (not strict about them); dcp.load has already failed on any
trainable key the checkpoint lacks."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint must agree with to be loaded (checked on load) and where training stood."""

    step: int
    model_type: str
    impl: str


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return RunDir(output_dir).checkpoint_part_dir(step, TRAINER_PART)


def committed_steps(output_dir: Path) -> list[int]:
    """Steps with a committed trainer checkpoint, ascending."""
    steps = step_dirs(RunDir(output_dir).checkpoints_root)
    return sorted(s for s in steps if (checkpoint_dir(output_dir, s) / COMMITTED).is_file())


def resolve_resume_step(output_dir: Path, resume_step: int | str | None, whole_run: bool = False) -> int | None:
    """The step to resume from (None: start from scratch) for `trainer.resume_step`; with `whole_run`, only steps
    whose whole-run checkpoint is committed count (`step_N/COMMITTED`, see slipstream.transport.checkpoints)."""
    if resume_step is None:
        return None
    steps = committed_run_steps(output_dir) if whole_run else committed_steps(output_dir)
    if resume_step == "latest":
        if not steps:
            root = RunDir(output_dir).checkpoints_root
            log.info(f"resume_step = 'latest': no committed checkpoint under {root}; starting at step 0")
        return steps[-1] if steps else None
    if resume_step not in steps:
        raise FileNotFoundError(
            f"trainer.resume_step = {resume_step} but {checkpoint_dir(output_dir, resume_step)} is not a committed "
            f"checkpoint (committed steps: {steps or 'none'}); pick one of those or 'latest'"
        )
    return int(resume_step)


def save_checkpoint(
    policy: nn.Module, optimizer: torch.optim.Optimizer, output_dir: Path, meta: CheckpointMeta, info: RankInfo
) -> Path:
    """Collective: write and commit the checkpoint of `meta.step`; returns its folder."""
    final_dir = checkpoint_dir(output_dir, meta.step)
    tmp_dir = RunDir(output_dir).checkpoint_part_tmp_dir(meta.step, TRAINER_PART)
    if info.is_main:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)  # left by a run that died while checkpointing
        (tmp_dir / "rng").mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=STATE_OPTIONS)
    with _single_process_ok():
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp_dir, no_dist=not dist.is_initialized())
    torch.save(_rng_state(), tmp_dir / "rng" / f"rank_{info.rank}.pt")
    barrier()
    if info.is_main:
        progress = {"format_version": CKPT_FORMAT_VERSION, "world_size": info.world_size, **meta.__dict__}
        atomic_write_text(tmp_dir / PROGRESS, json.dumps(progress, indent=2) + "\n")
        atomic_write_text(tmp_dir / COMMITTED, f"{meta.step}\n")
        commit_dir(tmp_dir, final_dir)
    barrier()
    return final_dir


def load_checkpoint(
    policy: nn.Module, optimizer: torch.optim.Optimizer, output_dir: Path, expected: CheckpointMeta, info: RankInfo
) -> None:
    """Collective: load the committed checkpoint of `expected.step` into `policy` and `optimizer` (resharded to
    this run's ranks) and restore this rank's RNG state."""
    path = checkpoint_dir(output_dir, expected.step)
    progress = read_progress(path / PROGRESS)
    saved = CheckpointMeta(progress["step"], progress["model_type"], progress["impl"])
    if progress["format_version"] != CKPT_FORMAT_VERSION or saved != expected:
        raise ValueError(
            f"{path} holds {saved} (format {progress['format_version']}) but this run expects {expected} (format "
            f"{CKPT_FORMAT_VERSION}); resume with the model and trainer.model_impl the checkpoint was written with"
        )
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=STATE_OPTIONS)
    state = {"model": model_sd, "optimizer": optim_sd}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(
        policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=LOAD_OPTIONS
    )
    rng_path = path / "rng" / f"rank_{info.rank}.pt"
    if rng_path.is_file():
        _set_rng_state(torch.load(rng_path, weights_only=True))
    else:
        # Written with fewer ranks: this rank had no RNG stream (training draws no random numbers today).
        log.warning(
            f"rank {info.rank}: {rng_path} does not exist (checkpoint of {progress['world_size']} ranks); RNG kept"
        )


def read_progress(path: Path) -> dict:
    """A checkpoint's progress.json, checked for the fields load_checkpoint compares (ValueError naming the file)."""
    fields = {"format_version": int, "world_size": int, "step": int, "model_type": str, "impl": str}
    return read_marker(path, fields)


@contextmanager
def _single_process_ok() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one rank has none, by design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
