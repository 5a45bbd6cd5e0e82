"""Per-node cleanup before a Slurm job's `slipstream rl` starts: end this user's processes of the same run directory
left on this node by an earlier job (`python -m slipstream.launch.stale RUN_DIR JOB_ID`). Processes of the current
job are never touched; a live run of another job is one the scheduler let overlap, and it is ended too, because two
runs cannot share a run directory (the new one would refuse to start)."""

import os
import sys
import time
from pathlib import Path

import psutil

from slipstream.rundir import RUN_DIR_ENV

STOP_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL for a stale process."""


def stale_processes(run_dir: Path, job_id: str) -> list[psutil.Process]:
    """This user's live processes (not this one) marked with run directory `run_dir` whose SLURM_JOB_ID is not
    `job_id`."""
    target, uid, me = str(Path(run_dir).resolve()), os.getuid(), os.getpid()
    found = []
    for proc in psutil.process_iter(["pid", "uids", "status"]):
        info = proc.info
        if info["pid"] == me or info["uids"] is None or info["uids"].real != uid:
            continue
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            env = proc.environ()
        except psutil.Error:
            continue  # exited meanwhile, or not readable
        if env.get(RUN_DIR_ENV) == target and env.get("SLURM_JOB_ID") != job_id:
            found.append(proc)
    return found


def end_stale_processes(run_dir: Path, job_id: str, grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM the stale processes of `run_dir`, SIGKILL those alive after `grace_s`; return their pids."""
    procs = stale_processes(run_dir, job_id)
    for proc in procs:
        try:
            print(f"[slipstream] ending pid {proc.pid} ({' '.join(proc.cmdline())[:100]}) left by an earlier job")
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [proc.pid for proc in procs]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m slipstream.launch.stale RUN_DIR JOB_ID", file=sys.stderr)
        return 2
    start = time.monotonic()
    pids = end_stale_processes(Path(argv[0]), argv[1])
    if pids:
        print(f"[slipstream] ended {len(pids)} stale process(es) in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
