"""CPU nodes (deployment.split_cpu_cores): the trainer's threads get cores of their own and vLLM and the orchestrator
the others, from the launcher's cores and vLLM's binding; the split reaches the children as CPU affinities."""

import os
import sys

import pytest

from slipstream.launch.cpu_cores import parse_bind, split_cores
from slipstream.launch.plan import ProcessSpec, build_plan
from slipstream.launch.supervisor import Supervisor
from tests.unit.test_placement import rl


def test_parse_bind_reads_vllm_core_lists():
    assert parse_bind("0-3") == [0, 1, 2, 3]
    assert parse_bind("0,2|5-6") == [0, 2, 5, 6]
    assert parse_bind("auto") is None and parse_bind("nobind") is None
    with pytest.raises(ValueError, match="cpu_threads_bind or VLLM_CPU_OMP_THREADS_BIND"):
        parse_bind("first")


@pytest.mark.parametrize(
    ("available", "threads", "bind", "inference", "trainer", "binds_vllm"),
    [
        ([0, 1], 1, None, (0,), (1,), True),  # the demo's 2-core VM
        ([0, 1, 2, 3], 2, None, (0, 1), (2, 3), True),
        ([0, 1, 2, 3], 1, "auto", (0, 1, 2), (3,), True),
        ([0, 1], 1, "1", (1,), (0,), False),  # vLLM's cores named (a test worker's share): the trainer takes the rest
        ([0, 1, 2, 3], 1, "0-1", (0, 1), (3,), False),
        ([4, 5], 1, None, (4,), (5,), True),  # the launcher's own affinity
    ],
)
def test_split(available, threads, bind, inference, trainer, binds_vllm):
    split = split_cores(available, threads, bind)
    assert (split.inference, split.trainer, split.bind_vllm) == (inference, trainer, binds_vllm)
    assert split.cpus("orchestrator") == split.cpus("inference") == inference and split.cpus("trainer") == trainer
    assert split.env("inference") == (
        {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, inference))} if binds_vllm else {}
    )
    assert split.env("trainer") == split.env("orchestrator") == {}


def test_each_vllm_rank_gets_its_share():
    split = split_cores([0, 1, 2, 3, 4], 1, None, vllm_ranks=2)
    assert (split.inference, split.trainer) == ((0, 1, 2, 3), (4,))
    assert split.env("inference") == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}  # one list per rank, as vLLM asks
    assert split_cores([0, 1], 1, None, vllm_ranks=2) is None  # one core for two ranks
    named = split_cores([0, 1, 2], 1, "0|1", vllm_ranks=2)  # the user's own per-rank lists stand
    assert (named.inference, named.trainer, named.env("inference")) == ((0, 1), (2,), {})


@pytest.mark.parametrize(
    ("available", "threads", "bind"),
    [
        ([0, 1], None, None),  # torch takes every core: nothing to give vLLM
        ([0], 1, None),
        ([0, 1], 2, None),
        ([0, 1], 2, "0"),  # two trainer threads, one core left
        ([0, 1], 1, "0-1"),  # vLLM binds every core
        ([0, 1], 1, "nobind"),
    ],
)
def test_no_split_where_none_fits(available, threads, bind):
    assert split_cores(available, threads, bind) is None


def test_plan_pins_a_cpu_nodes_processes(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    config = rl(trainer={"num_threads": 1})
    specs = {s.name: s for s in build_plan(config, gpus=[], cores=[0, 1])}
    assert {name: spec.cpus for name, spec in specs.items()} == {
        "inference": (0,),
        "trainer": (1,),
        "orchestrator": (0,),
    }
    assert specs["inference"].env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in specs["trainer"].env
    bound = {
        s.name: s
        for s in build_plan(rl(trainer={"num_threads": 1}, inference={"cpu_threads_bind": "1"}), gpus=[], cores=[0, 1])
    }
    assert (bound["inference"].cpus, bound["trainer"].cpus) == ((1,), (0,))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in bound["inference"].env  # the config's binding reaches vLLM itself
    for unsplit in (
        rl(),  # trainer.num_threads unset
        rl(trainer={"num_threads": 1}, deployment={"split_cpu_cores": False}),
        rl(trainer={"num_threads": 1}, deployment={"colocate": True}),  # taking turns: each gets every core
        rl(trainer={"num_threads": 1}, launch={"num_trainer_procs": 2}),  # two ranks need two cores
        rl(
            trainer={"num_threads": 1},
            deployment={"run": ["trainer", "orchestrator"]},
            weights={"transport": "filesystem"},
        ),
    ):
        assert all(spec.cpus == () for spec in build_plan(unsplit, gpus=[], cores=[0, 1]))
    assert all(spec.cpus == () for spec in build_plan(config, gpus=[0, 1], cores=[0, 1]))  # GPUs: no split
    ranks = {
        s.name: s.cpus
        for s in build_plan(rl(trainer={"num_threads": 1}, launch={"num_trainer_procs": 2}), gpus=[], cores=[0, 1, 2])
    }
    assert ranks == {"inference": (0,), "trainer": (1, 2), "orchestrator": (0,)}
    dp_config = rl(trainer={"num_threads": 1}, inference={"data_parallel_size": 2})
    dp = {s.name: s for s in build_plan(dp_config, gpus=[], cores=[0, 1, 2])}
    assert dp["inference"].env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and dp["trainer"].cpus == (2,)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin a child to one of them")
def test_a_child_and_what_it_starts_keep_to_their_cores(tmp_path):
    core = max(os.sched_getaffinity(0))
    script = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); " + (
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    )
    sup = Supervisor(grace_s=1.0)
    sup.start(ProcessSpec("child", [sys.executable, "-c", script], tmp_path / "child.log", cpus=(core,)))
    assert sup.procs["child"].wait(30) == 0
    assert (tmp_path / "child.log").read_text().split("\n")[:2] == [f"[{core}]", f"[{core}]"]
