"""Run directory: one owner of the layout, weight pruning that keeps what resume, verification and evaluation need,
the run lock, the scan for processes of a run, and the watchdog that ends them with their launcher."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from slipstream.config.loader import load_config
from slipstream.config.rl import RLConfig
from slipstream.launch import local
from slipstream.launch.plan import ProcessSpec
from slipstream.launch.supervisor import Supervisor
from slipstream.launch.watchdog import parse_launcher
from slipstream.rundir import (
    LAUNCHER_ENV,
    RUN_DIR_ENV,
    RunDir,
    RunLock,
    RunLockedError,
    launcher_env,
    prune_weights,
    run_processes,
    step_dirs,
    wait_no_run_processes,
    weights_to_keep,
)
from slipstream.transport.checkpoints import committed_run_steps, is_checkpoint_step, resume_weight_steps
from slipstream.weights.wire.published import is_ready, weights_dir


def test_layout_is_the_documented_one(tmp_path):
    run = RunDir(tmp_path)
    rel = {k: str(v.relative_to(tmp_path)) for k, v in {
        "batch": run.batch_path(3, 1), "ready": run.ready_marker(2), "probe": run.probe_path(2),
        "ckpt": run.checkpoint_marker(4), "part": run.checkpoint_part_dir(4, "trainer"),
        "tmp_part": run.checkpoint_part_tmp_dir(4, "orchestrator"), "metrics": run.metrics_path,
        "checks": run.weight_checks_path, "online": run.online_eval_path, "eval": run.eval_result_path(5),
        "log": run.log_path("trainer"), "config": run.config_path("rl"), "token": run.admin_token_path,
        "plots": run.plots_dir, "lock": run.lock_path,
    }.items()}  # fmt: skip
    assert rel == {
        "batch": "rollouts/step_3/rank_1.msgpack", "ready": "weights/step_2/READY", "probe": "weights/step_2/probe.json",
        "ckpt": "checkpoints/step_4/COMMITTED", "part": "checkpoints/step_4/trainer",
        "tmp_part": "checkpoints/step_4/.orchestrator.tmp", "metrics": "metrics.jsonl",
        "checks": "weight_checks.jsonl", "online": "eval/online.jsonl", "eval": "eval/step_5.json",
        "log": "logs/trainer.log", "config": "config/rl.toml", "token": "admin_token", "plots": "plots",
        "lock": ".lock",
    }  # fmt: skip
    assert weights_dir(tmp_path, 7) == run.weights_dir(7)  # the transport helpers delegate to RunDir


def _publish(run: RunDir, *steps: int) -> None:
    for step in steps:
        run.weights_dir(step).mkdir(parents=True)
        run.ready_marker(step).write_text(f"{step}\n")


def _commit(run: RunDir, *steps: int) -> None:
    for step in steps:
        run.checkpoint_dir(step).mkdir(parents=True)
        run.checkpoint_marker(step).write_text(f"{step}\n")


def test_step_listing_ignores_temporary_and_other_folders(tmp_path):
    run = RunDir(tmp_path)
    _publish(run, 1, 3)
    for name in (".tmp_step_4_99", ".deleting_step_2", "step_x", "notes"):
        (run.weights_root / name).mkdir()
    (run.weights_root / "step_5").mkdir()  # no READY: listed as a folder, not as published
    assert sorted(step_dirs(run.weights_root)) == [1, 3, 5] and run.published_steps() == [1, 3]


def test_pruning_keeps_what_resume_verification_and_evaluation_need(tmp_path):
    run = RunDir(tmp_path)
    _publish(run, *range(1, 10))
    _commit(run, 3)
    (run.weights_root / ".tmp_step_10_42").mkdir()  # being written by the trainer
    interval, max_steps = 3, 12
    needed = resume_weight_steps(committed_run_steps(tmp_path), run.published_steps(), interval, max_steps)
    assert needed == {3, 6, 9}  # committed 3; 6 and 9 are checkpoint steps whose commit may still come
    keep = weights_to_keep(run.published_steps(), 7, loading={5}, pending_eval={1}, checkpoint_steps_needed=needed,
                           keep_recent=0)  # fmt: skip
    assert keep == {1, 3, 5, 6, 7, 8, 9}
    _publish(run, 10)  # published after `keep` was computed: newer than the served version, never deleted
    assert prune_weights(run, keep) == [2, 4]
    assert run.published_steps() == [1, 3, 5, 6, 7, 8, 9, 10]
    assert (run.weights_root / ".tmp_step_10_42").is_dir()
    assert sorted(p.name for p in run.weights_root.iterdir() if p.name.startswith(".deleting")) == []
    assert all(is_ready(tmp_path, s) for s in committed_run_steps(tmp_path))  # resume can serve its step
    assert prune_weights(run, keep) == [] and prune_weights(run, set()) == []


def test_keep_recent_keeps_the_newest_on_top():
    keep = weights_to_keep([1, 2, 3, 4, 5, 6], 6, set(), set(), set(), keep_recent=3)
    assert keep == {4, 5, 6}
    assert weights_to_keep([1, 2, 3], 0, set(), set(), set(), 0) == {1, 2, 3}  # initial model served: keep all
    with pytest.raises(ValueError, match="keep_weights"):
        weights_to_keep([1], 1, set(), set(), set(), -1)


def test_pruning_policy_on_random_runs():
    rng = random.Random(0)
    for _ in range(500):
        max_steps, interval = rng.randint(1, 30), rng.choice([None, 1, 2, 5])
        published = sorted(rng.sample(range(1, max_steps + 1), rng.randint(0, max_steps)))
        served = rng.choice([0, *published])
        committed = sorted(s for s in published if is_checkpoint_step(s, interval, max_steps) and rng.random() < 0.5)
        loading, pending = (
            set(rng.sample(published, min(2, len(published)))),
            {s for s in published if rng.random() < 0.1},
        )
        needed = resume_weight_steps(committed, published, interval, max_steps)
        keep_recent = rng.randint(0, 3)
        keep = weights_to_keep(published, served, loading, pending, needed, keep_recent)
        must = (
            {s for s in published if s >= served}
            | loading
            | pending
            | set(committed)
            | set(published[-keep_recent:] if keep_recent else [])
        )
        must |= {s for s in published if s > max(committed, default=0) and is_checkpoint_step(s, interval, max_steps)}
        assert keep == must, (published, served, committed, loading, pending, keep_recent)


def test_run_lock_is_exclusive_names_its_holder_and_dies_with_it(tmp_path):
    run = RunDir(tmp_path)
    with RunLock(run):
        assert run.lock_path.read_text().split()[0] == str(os.getpid())
        with pytest.raises(RunLockedError, match=rf"pid {os.getpid()}.*`kill {os.getpid()}`"):
            RunLock(run).acquire()
    RunLock(run).acquire().release()  # free again once released
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from slipstream.rundir import RunDir, RunLock
        RunLock(RunDir({str(tmp_path)!r})).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()
    RunLock(run).acquire().release()  # SIGKILL of the holder released it: no stale lock


def _rl_config(tmp_path):
    return load_config(RLConfig, ["--model.name", "m", "--max-steps", "2", "--output-dir", str(tmp_path)])


def _sleeper(env_extra: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, **env_extra})


def test_second_launcher_on_a_locked_directory_exits_2(tmp_path, capsys):
    with RunLock(RunDir(tmp_path)):
        assert local.run_rl(_rl_config(tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"pid {os.getpid()}" in err and "in use by another `slipstream rl`" in err
    assert not (tmp_path / "config").exists()  # refused before touching the run


def test_scan_finds_the_processes_of_a_run_and_the_launcher_refuses(tmp_path, capsys, monkeypatch):
    run, other = RunDir(tmp_path / "run"), RunDir(tmp_path / "other")
    run.root.mkdir()
    mine = _sleeper({RUN_DIR_ENV: str(run.root.resolve())})
    theirs = _sleeper({RUN_DIR_ENV: str(other.root.resolve())})
    try:
        deadline = time.monotonic() + 10
        while mine.pid not in [p.pid for p in run_processes(run)]:
            assert time.monotonic() < deadline, "the scan never found the marked process"
            time.sleep(0.05)
        assert [p.pid for p in run_processes(run)] == [mine.pid]
        with pytest.raises(RunLockedError, match=rf"pid {mine.pid} \(python.*`kill {mine.pid}`"):
            wait_no_run_processes(run, timeout_s=0.2)
        monkeypatch.setattr(local, "EARLIER_RUN_EXIT_S", 0.2)
        assert local.run_rl(_rl_config(run.root)) == 2
        assert f"kill {mine.pid}" in capsys.readouterr().err
        RunLock(run).acquire().release()  # the refusal released the lock
    finally:
        for proc in (mine, theirs):
            proc.kill()
            proc.wait()
    wait_no_run_processes(run, timeout_s=5)  # returns once they are gone


def test_supervisor_gives_children_the_run_marker(tmp_path):
    run = RunDir(tmp_path)
    env = launcher_env(run)
    assert env[RUN_DIR_ENV] == str(tmp_path.resolve())
    pid, created = parse_launcher(env[LAUNCHER_ENV])
    assert pid == os.getpid() and created == psutil.Process().create_time()
    script = f"import os; print(os.environ[{RUN_DIR_ENV!r}], os.environ[{LAUNCHER_ENV!r}])"
    sup = Supervisor(grace_s=1, env=env)
    sup.start(ProcessSpec("probe", [sys.executable, "-c", script], run.log_path("probe"), must_run_to_end=False))
    sup.procs["probe"].wait(timeout=30)
    sup.stop_all()
    assert run.log_path("probe").read_text().split() == [env[RUN_DIR_ENV], env[LAUNCHER_ENV]]


WATCHED = """
import os, sys, threading, time
from slipstream.launch.watchdog import start_from_env
started = []
t = threading.Thread(target=lambda: started.append(start_from_env()))  # not the main thread
t.start(); t.join()
assert started == [True]
child = os.fork()  # a forked child has no threads: the watchdog must start again in it
if child == 0:
    time.sleep(60); os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


def test_watchdog_kills_processes_when_their_launcher_dies(tmp_path):
    fake_launcher = _sleeper({})
    created = psutil.Process(fake_launcher.pid).create_time()
    env = {LAUNCHER_ENV: f"{fake_launcher.pid}:{created!r}"}
    watched = subprocess.Popen([sys.executable, "-c", WATCHED], env={**os.environ, **env}, stdout=subprocess.PIPE)
    try:
        forked = psutil.Process(int(watched.stdout.readline()))
        time.sleep(1.0)
        assert watched.poll() is None and forked.is_running()  # alive while the launcher is
        fake_launcher.kill()
        fake_launcher.wait()
        assert watched.wait(timeout=5) == -signal.SIGKILL
        psutil.wait_procs([forked], timeout=5)
        assert not forked.is_running() or forked.status() == psutil.STATUS_ZOMBIE
    finally:
        for proc in (watched, fake_launcher):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_watchdog_rejects_a_malformed_marker():
    with pytest.raises(ValueError, match=f"{LAUNCHER_ENV}='123' is not"):
        parse_launcher("123")
