"""CPU cores of a node without GPUs (deployment.split_cpu_cores): the trainer's threads get cores of their own, and
vLLM (its API server, engine core and worker processes) and the orchestrator share the others.

Without a split only vLLM's worker threads are bound (VLLM_CPU_OMP_THREADS_BIND); its API server and engine-core
processes and the orchestrator float, and the kernel moves them onto the trainer's core whenever vLLM's worker keeps
its own core busy. Measured on the 2-core VM with the reverse-text demo: the one-thread trainer then got about two
thirds of its core (`top`: engine core 15%, orchestrator 7%, API server 5% beside it) and trained at ~45 tokens/s
against ~74 alone. The split is applied as each child's CPU affinity (inherited by everything it starts) and, where
neither inference.cpu_threads_bind nor the environment binds vLLM's threads, as VLLM_CPU_OMP_THREADS_BIND.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class CoreSplit:
    """Cores of the inference side (vLLM and the orchestrator) and of the trainer, disjoint."""

    inference: tuple[int, ...]
    trainer: tuple[int, ...]
    bind_vllm: bool
    """Whether the split also binds vLLM's threads (nothing else bound them)."""
    vllm_ranks: int = 1
    """vLLM's ranks (tensor x data parallel): each gets its own equal share of the inference cores."""

    def cpus(self, role: str) -> tuple[int, ...]:
        return self.trainer if role == "trainer" else self.inference

    def env(self, role: str) -> dict[str, str]:
        if role != "inference" or not self.bind_vllm:
            return {}
        share = len(self.inference) // self.vllm_ranks
        ranks = [self.inference[r * share : (r + 1) * share] for r in range(self.vllm_ranks)]
        return {BIND_ENV: "|".join(",".join(str(core) for core in cores) for cores in ranks)}


def parse_bind(bind: str) -> list[int] | None:
    """Cores named by a VLLM_CPU_OMP_THREADS_BIND value ("0-3", "0,2", "0-1|2-3" for several ranks); None for
    `auto` (vLLM picks) and `nobind`."""
    if bind.strip() in ("auto", "nobind", ""):
        return None
    cores: list[int] = []
    for part in bind.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        try:
            cores.extend(range(int(first), int(last or first) + 1))
        except ValueError as e:
            raise ValueError(
                f"cannot read the core list {bind!r} (inference.cpu_threads_bind or {BIND_ENV}): use ranges and "
                "commas such as 0-3 or 0,2, or auto"
            ) from e
    return sorted(set(cores))


def split_cores(
    available: Sequence[int], trainer_threads: int | None, bind: str | None, vllm_ranks: int = 1
) -> CoreSplit | None:
    """The split of `available` (this launcher's cores): vLLM on the cores `bind` names (else all but the last
    `trainer_threads`: the threads of all the trainer's ranks here), the trainer on the last `trainer_threads` of the
    others. None where no split fits: the trainer's thread count unset (torch takes every core), `bind` = nobind, or
    too few cores for either side (at least one per vLLM rank where the split binds them)."""
    if trainer_threads is None or (bind is not None and bind.strip() == "nobind"):
        return None
    named = parse_bind(bind) if bind is not None else None
    inference = [c for c in available if c in named] if named is not None else list(available[:-trainer_threads])
    rest = [c for c in available if c not in inference]
    if len(inference) < (vllm_ranks if named is None else 1) or len(rest) < trainer_threads:
        return None
    return CoreSplit(tuple(inference), tuple(rest[-trainer_threads:]), named is None, vllm_ranks)


def node_split(
    trainer_threads: int | None, cpu_threads_bind: str | None, cores: Sequence[int] | None = None, vllm_ranks: int = 1
) -> CoreSplit | None:
    """split_cores of `cores` (None: this process's CPU affinity), vLLM's binding taken from the config, else the
    environment."""
    bind = cpu_threads_bind if cpu_threads_bind is not None else os.environ.get(BIND_ENV)
    available = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    return split_cores(available, trainer_threads, bind, vllm_ranks)
