"""Each pytest-xdist worker's share of the machine's cores (tests/conftest.py applies it as a worker starts): two
workers on the 2-core machine each running 2 torch threads, and each starting vLLM servers that all bind core 0 (vLLM's
`auto` binding), would oversubscribe one core while the other waits."""

import os


def share_cores(environ: dict[str, str], cores: list[int]) -> int | None:
    """In pytest-xdist worker gwK of N, give this process its share of `cores` through `environ`: as many torch/OpenMP
    threads (OMP_NUM_THREADS, inherited by the trainers and orchestrators the tests start) and, for the vLLM servers
    the tests start, the K-th share of the cores (VLLM_CPU_OMP_THREADS_BIND; `inference.cpu_threads_bind` unset
    leaves it to the environment). What `environ` already sets stands. Returns the thread count for this process;
    None outside a worker (pytest alone, or xdist's controller, whose environment the workers inherit): every core."""
    worker = environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return None
    num_workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = max(1, len(cores) // num_workers)
    environ.setdefault("OMP_NUM_THREADS", str(share))
    if num_workers > 1:
        first = int(worker[2:]) * share % len(cores)
        environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores[first : first + share]))
    return int(environ["OMP_NUM_THREADS"])


def visible_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))
