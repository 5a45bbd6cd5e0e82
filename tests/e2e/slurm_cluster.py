"""A one-node Slurm cluster on loopback for tests: Debian's munged, slurmctld and slurmd started as background
processes with a generated munge key, slurm.conf, state and spool folders in a temporary directory, on free ports.

Running slurmd needs root. `make setup` installs the packages (apt-get) when it runs as root; without them the tests
fail saying so, and only a non-root run skips them (slurmd cannot start there)."""

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.helpers import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun", "sinfo", "squeue")
PACKAGES = "slurmctld slurmd slurm-client munge"
SBIN = ("/usr/sbin", "/sbin")


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    env: dict[str, str]
    """os.environ plus SLURM_CONF and a PATH with the daemons' folders."""

    def scontrol_job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` of one job as a dict (JobState, ExitCode, ...); {} once Slurm forgot it."""
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], env=self.env, capture_output=True, text=True, timeout=30
        )
        if proc.returncode != 0:
            return {}
        return dict(field.split("=", 1) for field in proc.stdout.split() if "=" in field)

    def wait_job_end(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Poll until the job has left PENDING/RUNNING/COMPLETING; return its record."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.scontrol_job(job_id)
            if info.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", None):
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id} still {self.scontrol_job(job_id).get('JobState')} after {timeout_s}s")


def missing_binaries(path: str) -> list[str]:
    return [name for name in BINARIES if shutil.which(name, path=path) is None]


def cluster_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), *SBIN])


@contextmanager
def one_node_cluster(root: Path) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd (as root) under `root`; stop them (and cancel every job) afterwards."""
    path = cluster_path()
    env = {**os.environ, "PATH": path}
    for name in ("state", "spool", "log", "munge"):
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, socket))
    env["SLURM_CONF"] = str(conf)
    procs: list[subprocess.Popen] = []
    try:
        munge_args = [f"--key-file={key}", f"--socket={socket}", f"--pid-file={root / 'munge' / 'munged.pid'}"]
        munge_args += [f"--log-file={root / 'log' / 'munged.log'}", f"--seed-file={root / 'munge' / 'seed'}"]
        procs.append(_start(["munged", "-F", "-f", *munge_args], root / "log" / "munged.out", env))
        _wait_for(lambda: socket.exists(), "munged's socket", root)
        procs.append(_start(["slurmctld", "-D", "-i"], root / "log" / "slurmctld.out", env))
        procs.append(_start(["slurmd", "-D", "-N", "localhost"], root / "log" / "slurmd.out", env))
        cluster = SlurmCluster(conf, env)
        _wait_for(lambda: _node_idle(env), "the node to be idle in sinfo", root)
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "--partition", "debug"], env=env, capture_output=True, timeout=30)
        _wait_no_jobs(env)
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _slurm_conf(root: Path, socket: Path) -> str:
    cpus = os.cpu_count() or 1
    return f"""ClusterName=slipstreamtest
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=600
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _node_idle(env: dict[str, str]) -> bool:
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and proc.stdout.strip() == "idle"


def _wait_for(predicate, what: str, root: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"----- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((root / "log").iterdir())
            )
            raise AssertionError(f"the test Slurm cluster did not come up: waited {timeout_s}s for {what}\n{logs}")
        time.sleep(0.5)


def _wait_no_jobs(env: dict[str, str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0 or not proc.stdout.strip():
            return
        time.sleep(1)
