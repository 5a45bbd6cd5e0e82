"""Whole-run resume through real vLLM: kill -9 the orchestrator at a random point after the first committed
checkpoint, `slipstream rl --resume`, and the run ends at the same step with the weights, losses and metrics of an
uninterrupted run of the same seed, every step trained exactly once. One live run per directory, and no orphans when
the launcher dies: a second `slipstream rl --resume` on a live run's directory is refused naming the launcher; SIGKILL
of the launcher alone (mid-run, real vLLM) leaves no process of the run 15 s later; `--resume` then ends with the
weights of an uninterrupted run, bit for bit.

The interrupted runs start their own vLLM (the kill must stop it, or leave none behind); the uninterrupted reference
and the resumed runs use one vLLM server in turn (`resume_server`), as runs against a long-lived inference server do:
a resumed run finds the weights of the run before it there, loads the model's initial weights back, then its
checkpoint's, and must still end bit for bit where the reference ended. The server is the session's (tests/e2e/
conftest.py's tiny_inference), which other runs may have used before the reference.

Other victims are covered elsewhere: benchmarks/chaos.py (tests/e2e/test_chaos.py) kills a trainer rank, the torchrun
agent, the launcher, the orchestrator and the inference server in one seeded run and checks every resume bit-exact and
the launcher naming the failed role."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import RESUME_MAX_STEPS as MAX_STEPS
from tests.e2e.helpers import processes_with_marker, resume_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
RELOAD_LINE = "not this run's initial ones: loading the initial weights from"
RUN_DIR_ENV = "SLIPSTREAM_RUN_DIR"  # spelled out: the test checks the contract, not the module's constant
ORPHAN_DEADLINE_S = 15.0
# a random point of the run after the first commit: (file that must exist, extra sleep bound in s)
KILL_POINTS = [
    ("checkpoints/step_1/COMMITTED", 0.5),
    ("rollouts/step_2/rank_0.msgpack", 0.3),
    ("weights/step_2/READY", 0.3),
    ("checkpoints/step_2/orchestrator/COMMITTED", 0.2),
    ("rollouts/step_3/rank_0.msgpack", 0.2),
]


@pytest.fixture(scope="module")
def resume_server(tiny_inference):
    """The vLLM server the reference and the resumed runs use in turn: the session's (`resume_config` has
    `tiny_rl_config`'s inference flags)."""
    return tiny_inference


@pytest.fixture(scope="module")
def resume_reference(resume_server, tiny_qwen3_dir, tmp_path_factory) -> Path:
    """Run directory of an uninterrupted run of `resume_config`, shared by the tests that interrupt and resume it."""
    root = tmp_path_factory.mktemp("reference")
    out = root / "run"
    cfg = write_config(root / "rl.toml", resume_server.run_config(resume_config(tiny_qwen3_dir, out)))
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(cfg)],
        env=resume_server.env(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return out


def _resumed_config(server, model_dir: Path, out: Path, path: Path) -> Path:
    """The interrupted run's config, resumed on the shared server."""
    return write_config(path, server.run_config(resume_config(model_dir, out)))


def _rl(config_path: Path, env: dict, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(config_path), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_gone(marker: str) -> None:
    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind by the run"


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "weights" / f"step_{MAX_STEPS}" / "model.safetensors")


def _victim_pid(marker: str, victim: str) -> int:
    """The trainer's worker process (under torchrun) or the orchestrator process of the run tagged `marker`."""
    needle = {"trainer": "config/trainer.toml", "orchestrator": "config/orchestrator.toml"}[victim]
    matches = {}
    for pid in processes_with_marker(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if needle in cmdline and "torch.distributed.run" not in cmdline:
            matches[pid] = ppid
    assert len(matches) == 1, matches
    return next(iter(matches))


@pytest.mark.parametrize("victim", ["orchestrator"])
def test_kill_and_resume_matches_an_uninterrupted_run(
    victim, resume_server, resume_reference, tiny_qwen3_dir, tmp_path, run_env
):
    reference = resume_reference  # an uninterrupted run of the same config
    marker, env = run_env
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", resume_config(tiny_qwen3_dir, out))
    rng = random.Random()
    point, max_sleep = rng.choice(KILL_POINTS)
    sleep = rng.uniform(0.0, max_sleep)
    print(f"killing the {victim} once {point} exists, {sleep:.2f}s later")

    launcher = _rl(cfg, env)
    try:
        deadline = time.monotonic() + 400
        while not (out / point).exists():
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, f"the run never reached {point}"
            time.sleep(0.02)
        time.sleep(sleep)
        assert launcher.poll() is None, "the run ended before the kill"
        os.kill(_victim_pid(marker, victim), signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = _finish(launcher, 60)
        assert time.monotonic() - killed_at < 30, "the launcher took more than 30 s to stop the run"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode != 0 and f"error: {victim} " in stderr, stderr
    if victim == "orchestrator":  # a direct child of the launcher (the trainer victim is a rank under torchrun)
        assert "orchestrator was killed by signal 9" in stderr, stderr
    _wait_gone(marker)
    trained_before = [m["step"] for m in _metrics(out)]
    assert trained_before == list(range(1, len(trained_before) + 1)) and len(trained_before) < MAX_STEPS

    resumed_cfg = _resumed_config(resume_server, tiny_qwen3_dir, out, tmp_path / "rl_resumed.toml")
    resumed = _rl(resumed_cfg, resume_server.env(env), "--resume")
    stdout, stderr = _finish(resumed, 600)
    assert resumed.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    _wait_gone(marker)
    assert RELOAD_LINE in (out / "logs" / "orchestrator.log").read_text()  # the reference's weights were served
    committed = sorted(int(p.parent.name.removeprefix("step_")) for p in (out / "checkpoints").glob("*/COMMITTED"))
    resume_step = int(re.search(r"resuming \S+ after step (\d+)", stdout).group(1))
    assert 1 <= resume_step <= len(trained_before)
    assert f"resumed from {out}/checkpoints/step_{resume_step}" in (out / "logs" / "trainer.log").read_text()
    trained_after = [int(s) for s in re.findall(r"\] step (\d+)/", stdout)]  # the launcher's progress lines
    assert trained_after == list(range(resume_step + 1, MAX_STEPS + 1)), stdout

    # every step trained exactly once, and each the same as in the uninterrupted run
    metrics, want = _metrics(out), _metrics(reference)
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    for got, ref in zip(metrics, want, strict=True):
        for key in ("loss", "grad_norm", "reward/mean", "num_tokens"):
            assert got[key] == ref[key], (got["step"], key, got[key], ref[key])
    final, ref_final = _final_weights(out), _final_weights(reference)
    assert final.keys() == ref_final.keys()
    for name, tensor in ref_final.items():
        assert torch.equal(final[name], tensor), name
    # retention (keep_last = 1, keep_every = 2): the newest and the even steps are left
    assert committed == [2, 4], committed


def _rl_logged(config_path: Path, env: dict, log_dir: Path, name: str, *extra: str) -> subprocess.Popen:
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


def _wait_for_step(launcher: subprocess.Popen, out: Path, step: int, log_dir: Path) -> None:
    deadline = time.monotonic() + 400
    while not any(m["step"] >= step for m in _metrics(out)):
        assert launcher.poll() is None, (log_dir / "first.err").read_text()[-3000:]
        assert time.monotonic() < deadline, f"the run never logged step {step}"
        time.sleep(0.1)


def test_launcher_kill_leaves_no_orphans_and_resume_matches(
    resume_server, resume_reference, tiny_qwen3_dir, tmp_path, run_env
):
    marker, env = run_env
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", resume_config(tiny_qwen3_dir, out))
    launcher = _rl_logged(cfg, env, tmp_path, "first")
    try:
        _wait_for_step(launcher, out, 1, tmp_path)
        # the run is held mid-way while a second launcher starts (it needs seconds, under load more than the run's
        # remaining steps): its trainer is stopped, so the run cannot end before the refusal is checked
        trainers = _trainer_ranks(out)
        assert trainers, _describe(_marked_by_run_dir(out))
        for pid in trainers:
            os.kill(pid, signal.SIGSTOP)
        try:
            assert launcher.poll() is None and not any(m["step"] == MAX_STEPS for m in _metrics(out)), "ended"

            # a second launcher on the live run's directory is refused, naming the holder, and touches nothing
            second = _rl_logged(cfg, env, tmp_path, "second", "--resume")
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
    assert trained_before == list(range(1, len(trained_before) + 1)) and len(trained_before) < MAX_STEPS

    resumed_cfg = _resumed_config(resume_server, tiny_qwen3_dir, out, tmp_path / "rl_resumed.toml")
    resumed = _rl_logged(resumed_cfg, resume_server.env(env), tmp_path, "resumed", "--resume")
    assert resumed.wait(timeout=600) == 0, (tmp_path / "resumed.err").read_text()[-5000:]
    assert RELOAD_LINE in (out / "logs" / "orchestrator.log").read_text()
    metrics, want = _metrics(out), _metrics(resume_reference)
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    for got, ref in zip(metrics, want, strict=True):
        assert (got["loss"], got["reward/mean"]) == (ref["loss"], ref["reward/mean"]), got["step"]
    final, ref_final = (load_file(o / "weights" / f"step_{MAX_STEPS}" / "model.safetensors")
                        for o in (out, resume_reference))  # fmt: skip
    assert final.keys() == ref_final.keys()
    for name, tensor in ref_final.items():
        assert torch.equal(final[name], tensor), name
