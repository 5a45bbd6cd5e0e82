"""One live run per directory, and no orphans when the launcher dies: a second `slipstream rl --resume` on a live
run's directory is refused naming the launcher; SIGKILL of the launcher alone (mid-run, real vLLM) leaves no process
of the run 15 s later; `--resume` then ends with the weights of an uninterrupted run, bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import RESUME_MAX_STEPS, processes_with_marker, resume_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
RUN_DIR_ENV = "SLIPSTREAM_RUN_DIR"  # spelled out: the test checks the contract, not the module's constant
ORPHAN_DEADLINE_S = 15.0


def _rl(config_path: Path, env: dict, log_dir: Path, name: str, *extra: str) -> subprocess.Popen:
    """`slipstream rl` with stdout/stderr in files outside the run directory (`<name>.out`, `<name>.err`)."""
    cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(config_path), *extra]
    with open(log_dir / f"{name}.out", "w") as out, open(log_dir / f"{name}.err", "w") as err:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)


def _marked_by_run_dir(run_dir: Path) -> list[int]:
    """Live processes whose environment carries this run's SLIPSTREAM_RUN_DIR (read from /proc/<pid>/environ)."""
    return processes_with_marker(str(run_dir.resolve()), var=RUN_DIR_ENV)


def _holding_files_under(run_dir: Path) -> dict[int, str]:
    """pid -> one open file under the run directory, of this user's live processes."""
    root, uid, holders = str(run_dir.resolve()), os.getuid(), {}
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            paths = [f.path for f in proc.open_files() if f.path.startswith(root + os.sep)]
        except psutil.Error:
            continue
        if paths:
            holders[proc.pid] = paths[0]
    return holders


def _describe(pids) -> str:
    lines = []
    for pid in pids:
        try:
            lines.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:160]}")
        except psutil.Error:
            lines.append(f"{pid}: (gone)")
    return "\n".join(lines)


def _trainer_ranks(run_dir: Path) -> list[int]:
    """The run's trainer rank processes (`slipstream trainer` under torchrun, not torchrun itself)."""
    ranks = []
    for pid in _marked_by_run_dir(run_dir):
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if "trainer" in cmd and "slipstream" in cmd and "torch.distributed.run" not in cmd:
            ranks.append(pid)
    return ranks


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_step(launcher: subprocess.Popen, out: Path, step: int, log_dir: Path) -> None:
    deadline = time.monotonic() + 400
    while not any(m["step"] >= step for m in _metrics(out)):
        assert launcher.poll() is None, (log_dir / "first.err").read_text()[-3000:]
        assert time.monotonic() < deadline, f"the run never logged step {step}"
        time.sleep(0.1)


def test_launcher_kill_leaves_no_orphans_and_resume_matches(resume_reference, tiny_qwen3_dir, tmp_path, run_env):
    marker, env = run_env
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", resume_config(tiny_qwen3_dir, out))
    launcher = _rl(cfg, env, tmp_path, "first")
    try:
        _wait_for_step(launcher, out, 1, tmp_path)
        # the run is held mid-way while a second launcher starts (it needs seconds, under load more than the run's
        # remaining steps): its trainer is stopped, so the run cannot end before the refusal is checked
        trainers = _trainer_ranks(out)
        assert trainers, _describe(_marked_by_run_dir(out))
        for pid in trainers:
            os.kill(pid, signal.SIGSTOP)
        try:
            assert launcher.poll() is None and not any(m["step"] == RESUME_MAX_STEPS for m in _metrics(out)), "ended"

            # a second launcher on the live run's directory is refused, naming the holder, and touches nothing
            second = _rl(cfg, env, tmp_path, "second", "--resume")
            assert second.wait(timeout=120) == 2, (tmp_path / "second.err").read_text()
            refusal = (tmp_path / "second.err").read_text()
            assert f"pid {launcher.pid}" in refusal and f"kill {launcher.pid}" in refusal, refusal
            assert launcher.poll() is None
        finally:
            for pid in trainers:  # a stopped process cannot run its watchdog: let it go on before the kill below
                os.kill(pid, signal.SIGCONT)

        run_pids = _marked_by_run_dir(out)
        assert len(run_pids) >= 3, _describe(run_pids)  # inference (+ vLLM engine), trainer (+ worker), orchestrator
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher only
        launcher.wait()
        deadline = time.monotonic() + ORPHAN_DEADLINE_S
        while (left := _marked_by_run_dir(out)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], f"left alive {ORPHAN_DEADLINE_S:.0f}s after the launcher's SIGKILL:\n{_describe(left)}"
        holders = _holding_files_under(out)
        assert holders == {}, f"processes still holding files of the run: {holders}\n{_describe(holders)}"
        assert processes_with_marker(marker) == [], _describe(processes_with_marker(marker))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in processes_with_marker(marker):  # descendants of the launcher this test started, if any were left
            os.kill(pid, signal.SIGKILL)
    trained_before = [m["step"] for m in _metrics(out)]
    assert trained_before == list(range(1, len(trained_before) + 1)) and len(trained_before) < RESUME_MAX_STEPS

    resumed = _rl(cfg, env, tmp_path, "resumed", "--resume")
    assert resumed.wait(timeout=600) == 0, (tmp_path / "resumed.err").read_text()[-5000:]
    metrics, want = _metrics(out), _metrics(resume_reference)
    assert [m["step"] for m in metrics] == list(range(1, RESUME_MAX_STEPS + 1))
    for got, ref in zip(metrics, want, strict=True):
        assert (got["loss"], got["reward/mean"]) == (ref["loss"], ref["reward/mean"]), got["step"]
    final, ref_final = (load_file(o / "weights" / f"step_{RESUME_MAX_STEPS}" / "model.safetensors")
                        for o in (out, resume_reference))  # fmt: skip
    assert final.keys() == ref_final.keys()
    for name, tensor in ref_final.items():
        assert torch.equal(final[name], tensor), name
