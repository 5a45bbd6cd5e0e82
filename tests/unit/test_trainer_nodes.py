"""A trainer across nodes (launch/trainer_nodes.py): the launch id every trainer node needs, and the wait of the other
nodes for trainer node 0's configs of this launch. (Three nodes running it for real: tests/e2e/test_slurm.py.)"""

import threading
import time

import pytest

from slipstream.config.loader import deep_merge, validate_config
from slipstream.config.rl import RLConfig
from slipstream.launch.trainer_nodes import (
    LAUNCH_ID_ENV,
    LAUNCH_ID_FILE,
    publish_launch,
    run_secondary_trainer,
    wait_for_launch,
)
from slipstream.rundir import RunDir

BASE = {"max_steps": 2, "model": {"name": "some-model"}, "orchestrator": {"batch_size": 8, "group_size": 4}}


def _node(tmp_path, rank: int) -> RLConfig:
    run = ["trainer", "orchestrator"] if rank == 0 else ["trainer"]
    sections = {
        "output_dir": str(tmp_path / "run"),
        "deployment": {"run": run},
        "launch": {"trainer_nodes": 2, "trainer_node_rank": rank},
        "weights": {"transport": "filesystem"},
    }
    return validate_config(RLConfig, deep_merge(BASE, sections))


def test_a_second_trainer_node_without_a_launch_id_says_how_to_set_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(LAUNCH_ID_ENV, raising=False)
    assert run_secondary_trainer(_node(tmp_path, 1)) == 2
    assert f"set {LAUNCH_ID_ENV} to one value per launch, the same on every trainer node" in capsys.readouterr().err


def test_the_other_nodes_wait_for_this_launchs_configs(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    run.root.mkdir(parents=True)
    (run.root / LAUNCH_ID_FILE).write_text("job-1\n")  # an earlier launch's configs
    with pytest.raises(TimeoutError, match="did not write the configs of launch job-2"):
        wait_for_launch(run, "job-2", 0.6)
    monkeypatch.setenv(LAUNCH_ID_ENV, "job-2")
    publisher = threading.Timer(0.5, publish_launch, args=(_node(tmp_path, 0),))
    publisher.start()
    start = time.monotonic()
    wait_for_launch(run, "job-2", 10)
    assert 0.4 < time.monotonic() - start < 5
    assert (run.root / LAUNCH_ID_FILE).read_text() == "job-2\n"


def test_supervising_turns_sigterm_into_a_stop_and_stops_the_children():
    """The launchers' shared signal handling (launch/supervisor.supervising): SIGTERM inside the block raises
    StopRequested named after it; leaving the block stops every child and restores the previous handlers."""
    import os
    import signal

    from slipstream.launch.supervisor import StopRequested, supervising

    class Children:
        stopped = 0

        def stop_all(self) -> None:
            self.stopped += 1

    children, before = Children(), signal.getsignal(signal.SIGTERM)
    with pytest.raises(StopRequested, match="SIGTERM"), supervising(children):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # interrupted by the handler
    assert children.stopped == 1 and signal.getsignal(signal.SIGTERM) is before
