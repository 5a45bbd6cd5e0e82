"""`slipstream rl` with `[slurm]` against a real one-node Slurm (munged, slurmctld, slurmd on loopback): the job trains
the tiny model through real vLLM, exit codes travel from a node to `sbatch --wait`, `scancel` mid-run leaves no
process behind and `--resume` in a second job continues from the last checkpoint. The two-node layout's per-node
script runs twice on this machine as the two nodes of a fake allocation (SLURM_* of a 2-node job, both loopback)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slipstream.rundir import RunDir
from tests.e2e.helpers import free_port, processes_with_marker, tiny_rl_config, write_config
from tests.e2e.slurm_cluster import PACKAGES, SlurmCluster, cluster_path, missing_binaries, one_node_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    if os.geteuid() != 0:
        pytest.skip("a test Slurm cluster needs root (slurmd); run the tests as root to include them")
    if missing := missing_binaries(cluster_path()):
        pytest.fail(
            f"Slurm is not installed ({', '.join(missing)} missing): `make setup` installs it as root with apt-get; "
            f"or run `apt-get install -y {PACKAGES}`"
        )
    with one_node_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _rl(config: Path, env: dict, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(config), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _job_id(stdout: str) -> str:
    match = re.search(r"submitted job (\d+)", stdout)
    assert match, stdout
    return match.group(1)


def _logs(out: Path) -> str:
    parts = []
    for path in sorted(out.rglob("*.log")):
        parts.append(f"----- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
    return "\n".join(parts)


def _wait_gone(marker: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_marker(marker) == [], "processes left behind by the job"


def test_a_failing_node_fails_the_job_with_its_exit_code(slurm_cluster, tiny_qwen3_dir, tmp_path):
    out = tmp_path / "run"
    config = tiny_rl_config(tiny_qwen3_dir, out, max_steps=3)
    config["slurm"] = {"wait": True, "setup": ["echo 'setup failed' >&2; exit 3"]}
    proc = _rl(write_config(tmp_path / "rl.toml", config), slurm_cluster.env, timeout=120)
    assert proc.returncode == 3, f"{proc.stdout}\n{proc.stderr}"
    job = _job_id(proc.stdout)
    assert slurm_cluster.scontrol_job(job)["ExitCode"] == "3:0"
    assert "setup failed" in (out / "slurm" / "logs" / f"job_{job}_node_0.log").read_text()


@pytest.mark.timeout(1200)
def test_scancel_leaves_nothing_and_resume_trains_to_the_end_in_a_new_job_with_per_node_logs(
    slurm_cluster, tiny_qwen3_dir, tmp_path, run_env
):
    """scancel mid-run, then `--resume` with `--slurm.wait`: the second job trains every remaining step, exits 0 through
    `sbatch --wait` and writes the per-node logs. Merged with test_job_trains_three_steps_and_writes_per_node_logs,
    whose fresh 3-step job started the same processes and wrote the same logs as this resumed one (its assertions are
    the block after the resume): one Slurm job and one vLLM start less in the suite."""
    marker, env = run_env
    env = {**slurm_cluster.env, **env}
    out, max_steps = tmp_path / "run", 8  # the first job is cancelled right after step 1 commits (~1 s per step)
    config = tiny_rl_config(tiny_qwen3_dir, out, max_steps=max_steps, checkpoint={"interval": 1, "keep_last": 2})
    config["slurm"] = {"job_name": "tiny"}
    path = write_config(tmp_path / "rl.toml", config)
    proc = _rl(path, env, timeout=60)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    job = _job_id(proc.stdout)
    deadline = time.monotonic() + 600
    while not RunDir(out).committed_checkpoint_steps():
        assert time.monotonic() < deadline, f"no checkpoint committed in 600s\n{_logs(out)}"
        assert slurm_cluster.scontrol_job(job).get("JobState") in ("PENDING", "RUNNING"), _logs(out)
        time.sleep(0.2)
    assert processes_with_marker(marker), "the job's processes carry the test's marker"
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    info = slurm_cluster.wait_job_end(job, 120)
    assert info["JobState"] == "CANCELLED", info
    _wait_gone(marker)
    done = [m["step"] for m in _metrics(out)] if (out / "metrics.jsonl").exists() else []
    assert len(done) < max_steps, "the job finished before scancel: the test cannot check a cancel"
    last = RunDir(out).committed_checkpoint_steps()[-1]
    log_sizes = {role: RunDir(out).log_path(role).stat().st_size for role in ("inference", "trainer", "orchestrator")}

    start = time.monotonic()
    proc = _rl(path, env, "--resume", "--slurm.wait", "true", timeout=900)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{_logs(out)}"
    second = _job_id(proc.stdout)
    node_log = (out / "slurm" / "logs" / f"job_{second}_node_0.log").read_text()
    resumed = re.search(r"resuming \S+ after step (\d+)", node_log)
    assert resumed and int(resumed.group(1)) >= last, node_log
    assert [m["step"] for m in _metrics(out)] == list(range(1, max_steps + 1))
    # the completed job: its state, exit code and name in Slurm, its node's and the job's logs, each role's log
    info = slurm_cluster.scontrol_job(second)
    assert (info["JobState"], info["ExitCode"], info["JobName"]) == ("COMPLETED", "0:0", "tiny")
    assert "role all" in node_log and f"done: {max_steps} steps" in node_log, node_log
    assert f"job {second} on localhost" in (out / "slurm" / "logs" / f"job_{second}.log").read_text()
    for role, size in log_sizes.items():
        assert RunDir(out).log_path(role).stat().st_size > size, role  # written by this job too
    assert (out / "slurm" / f"job_{second}" / "all.exit").read_text().strip() == "0"
    _wait_gone(marker)
    print(f"resumed slurm job: {time.monotonic() - start:.0f}s")


@pytest.mark.timeout(900)
def test_three_node_script_runs_as_three_nodes_on_this_machine(slurm_cluster, tiny_qwen3_dir, tmp_path, run_env):
    """The rendered node.sh run three times on this machine as the nodes of a 3-node allocation: inference on node 0,
    the trainer across nodes 1 and 2 (torchrun's static rendezvous on node 1, one gloo rank each), the orchestrator
    on node 1; gloo weights."""
    marker, env = run_env
    out = tmp_path / "run"
    config = tiny_rl_config(tiny_qwen3_dir, out, max_steps=3, weights={"transport": "gloo", "master_port": free_port()})
    config["slurm"] = {"num_nodes": 3, "trainer_nodes": 2, "grace_s": 5}
    config["launch"]["trainer_master_port"] = free_port()
    proc = _rl(write_config(tmp_path / "rl.toml", config), env, "--dry-run", timeout=60)
    assert proc.returncode == 0, proc.stderr
    node_script = out / "slurm" / "node.sh"
    assert proc.stdout.strip().endswith(f"sbatch --parsable {out / 'slurm' / 'job.sbatch'}")
    allocation = {
        "SLURM_JOB_ID": "424242",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_NODELIST": "localhost,localhost,localhost",
        "SLIPSTREAM_ADMIN_TOKEN": "shared-by-the-job-script",
    }
    start = time.monotonic()
    codes, logs = run_as_nodes(node_script, {**slurm_cluster.env, **env, **allocation}, 3, tmp_path, 600)
    assert codes == [0, 0, 0], f"{logs}\n{_logs(out)}"
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3]
    assert "role inference" in logs[0] and "trainer ended (exit 0); stopping inference" in logs[0], logs[0]
    assert "role trainer" in logs[1] and "done: 3 steps" in logs[1], logs[1]
    assert "role trainer_1" in logs[2] and "trainer node 1: done" in logs[2], logs[2]
    inference_dir = out / "slurm" / "nodes" / "inference_0"
    assert RunDir(inference_dir).log_path("inference").stat().st_size > 0
    assert {p.name for p in RunDir(out).logs_dir.iterdir()} >= {"trainer.log", "trainer_node1.log", "orchestrator.log"}
    assert "inference.log" not in {p.name for p in RunDir(out).logs_dir.iterdir()}
    # both trainer nodes' ranks trained every step: the orchestrator wrote one batch per rank
    assert (out / "config" / "orchestrator.toml").read_text().count("num_trainer_ranks = 2") == 1
    # and both sent their own rows of every version to vLLM (weights/send/piece_send.py), checked by the probe
    assert json.loads((RunDir(out).weights_dir(3) / "manifest.json").read_text())["senders"] == 2
    _wait_gone(marker)
    print(f"three-node per-node scripts, 3 steps: {time.monotonic() - start:.0f}s")


@pytest.mark.timeout(600)
def test_sft_node_script_runs_as_two_nodes_on_this_machine(slurm_cluster, tiny_qwen3_dir, tmp_path, run_env):
    """`slipstream sft` with [slurm] num_nodes = 2: the rendered node.sh run twice on this machine as the nodes of a
    fake 2-node allocation (torchrun's static rendezvous on the first, one gloo rank each) fine-tunes 2 steps over 2
    data ranks and writes the model folder."""
    from tests.unit.test_sft_loop import _write_data

    marker, env = run_env
    out = tmp_path / "run"
    config = {
        "model": {"name": str(tiny_qwen3_dir)},
        "data": {"train_files": [str(_write_data(tmp_path / "train.jsonl", 8, seed=0))]},
        "output_dir": str(out),
        "max_steps": 2,
        "batch_size": 4,
        "micro_batch_tokens": 64,
        "device": "cpu",
        "num_threads": 1,
        "master_port": free_port(),
        "slurm": {"num_nodes": 2},
    }
    path = write_config(tmp_path / "sft.toml", config)
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "sft", "-c", str(path), "--dry-run"], env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    allocation = {"SLURM_JOB_ID": "515151", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "localhost,localhost"}
    node_script = out / "slurm" / "node.sh"
    codes, logs = run_as_nodes(node_script, {**slurm_cluster.env, **env, **allocation}, 2, tmp_path, 300)
    assert codes == [0, 0], "\n".join(logs)
    assert "2 rank(s), 2 data rank(s)" in logs[0], logs[0]
    assert [m["step"] for m in _metrics(out)] == [1, 2]
    assert (RunDir(out).weights_dir(2) / "model.safetensors").exists()
    _wait_gone(marker)


def run_as_nodes(script: Path, env: dict, num_nodes: int, tmp_path: Path, timeout_s: float) -> tuple[list, list]:
    """Run a rendered node.sh once per node of a fake allocation (SLURM_NODEID 0 .. num_nodes - 1, all at once, each
    logging to tmp_path/node_<id>.log); their exit codes and logs."""
    nodes = []
    for node_id in range(num_nodes):
        log = open(tmp_path / f"node_{node_id}.log", "w")
        node_env = {**env, "SLURM_NODEID": str(node_id)}
        nodes.append(subprocess.Popen(["bash", str(script)], env=node_env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [node.wait(timeout=timeout_s) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    return codes, [(tmp_path / f"node_{i}.log").read_text() for i in range(num_nodes)]
