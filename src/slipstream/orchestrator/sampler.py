"""Deterministic task sampling: the train split is reshuffled every epoch from (seed, epoch).

Tasks form one stream (`task_at(i)`, the i-th task drawn); the i-th task depends only on (seed, i), so a resumed
run continues the same sequence.
"""

import hashlib
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from slipstream.envs.base import Task


class TaskSampler:
    """Yields `tasks_per_step` tasks for each step, walking epoch-wise permutations of `tasks`."""

    def __init__(self, tasks: Sequence[Task], tasks_per_step: int, seed: int) -> None:
        if not tasks:
            raise ValueError("the environment's train split has no tasks")
        if tasks_per_step < 1:
            raise ValueError(f"tasks_per_step must be >= 1, got {tasks_per_step}")
        self.tasks = tasks
        self.tasks_per_step = tasks_per_step
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))}
        return self._perms[epoch]

    def task_at(self, index: int) -> Task:
        """The `index`-th task of the stream (0-based)."""
        if index < 0:
            raise ValueError(f"task indices start at 0, got {index}")
        epoch, offset = divmod(index, len(self.tasks))
        return self.tasks[int(self._permutation(epoch)[offset])]

    def tasks_for_step(self, step: int) -> list[Task]:
        """Tasks `(step - 1) * tasks_per_step ...` of the stream: those of `step` (1-based) in a synchronous run."""
        if step < 1:
            raise ValueError(f"steps start at 1, got {step}")
        start = (step - 1) * self.tasks_per_step
        return [self.task_at(index) for index in range(start, start + self.tasks_per_step)]


class TaskCursor:
    """The stream position of the task each new group gets: positions to generate again (groups that were in flight
    or buffered at the checkpoint a run resumed from) first, in order, then the stream from `next_index` on."""

    def __init__(self, next_index: int = 0, requeued: Iterable[int] = ()) -> None:
        self.next_index = next_index
        self.requeued = deque(sorted(requeued))

    def take(self) -> int:
        if self.requeued:
            return self.requeued.popleft()
        self.next_index += 1
        return self.next_index - 1

    def snapshot(self, unfinished: Iterable[int]) -> tuple[int, list[int]]:
        """(next_index, positions to generate again) for a checkpoint, given the positions of the groups dispatched
        but not yet trained (in flight or buffered)."""
        return self.next_index, sorted({*unfinished, *self.requeued})


def request_seed(seed: int, task_index: int) -> int:
    """Base sampling seed of a rollout group's requests: a hash of the run's seed and the task's stream position."""
    digest = hashlib.blake2b(f"rollout:{seed}:{task_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 31)  # leaves room for the per-sample and per-turn offsets
