"""tests/cores.py: each pytest-xdist worker's threads and vLLM cores."""

from tests.cores import share_cores


def test_two_workers_on_two_cores_get_one_thread_and_a_vllm_core_each():
    for worker, core in (("gw0", "0"), ("gw1", "1")):
        environ = {"PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_WORKER_COUNT": "2"}
        assert share_cores(environ, [0, 1]) == 1
        assert environ["OMP_NUM_THREADS"] == "1" and environ["VLLM_CPU_OMP_THREADS_BIND"] == core


def test_shares_are_of_the_visible_cores_and_wrap_around_past_them():
    environ = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    assert share_cores(environ, [4, 5, 6, 7]) == 2 and environ["VLLM_CPU_OMP_THREADS_BIND"] == "6,7"
    environ = {"PYTEST_XDIST_WORKER": "gw2", "PYTEST_XDIST_WORKER_COUNT": "3"}
    assert share_cores(environ, [0, 1]) == 1 and environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_what_the_environment_sets_stands_and_one_worker_binds_nothing():
    environ = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "2"}
    environ["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    assert share_cores(environ, [0, 1]) == 2 and environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    environ = {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "1"}
    assert share_cores(environ, [0, 1]) == 2 and "VLLM_CPU_OMP_THREADS_BIND" not in environ


def test_outside_a_worker_nothing_changes():
    """pytest alone, or pytest-xdist's controller (its workers inherit its environment, so it must set nothing)."""
    environ: dict[str, str] = {}
    assert share_cores(environ, [0, 1]) is None and environ == {}
