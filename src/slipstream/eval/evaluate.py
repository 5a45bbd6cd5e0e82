"""Evaluate the served policy on an environment split: seeded requests per task, env rewards, pass@k.

`evaluate` needs only a GenerationClient and an environment, so the orchestrator can call it for online
evaluation; `slipstream eval` (eval/run.py) wraps it with a server, a progress bar and a results file.
"""

import asyncio
import time
from collections.abc import Callable, Sequence

from slipstream.config.orchestrator import SamplingConfig
from slipstream.envs.base import AnyEnvironment, Task, is_multi_turn
from slipstream.eval.results import EvalResult, TaskResult, summarize
from slipstream.eval.tasks import evaluate_multi_turn_task, evaluate_single_turn_task
from slipstream.rollout.client import GenerationClient
from slipstream.rollout.limiter import CompletionLimiter, WeightedSemaphore


def default_pass_ks(num_samples: int) -> list[int]:
    """Powers of two below num_samples, and num_samples."""
    return [*(1 << i for i in range(num_samples.bit_length()) if 1 << i < num_samples), num_samples]


async def evaluate(
    client: GenerationClient,
    env: AnyEnvironment,
    split: str,
    num_samples: int,
    sampling: SamplingConfig,
    seed: int | None,
    limiter: CompletionLimiter | None = None,
    *,
    num_tasks: int | None = None,
    pass_threshold: float = 1.0,
    pass_ks: Sequence[int] | None = None,
    policy_version: int = 0,
    on_task_done: Callable[[TaskResult], None] | None = None,
) -> EvalResult:
    """Sample `num_samples` completions (or rollouts, for multi-turn environments) of each of the first `num_tasks`
    tasks of `split` (None: all), score them with the environment, and summarize.

    Requests are seeded from `seed` and the task id (None: unseeded, not reproducible); a CPU vLLM server must then
    run without chunked prefill (see eval/server.py). `limiter` bounds completions in flight (None: no bound; the
    server queues them). `policy_version` names the served policy (its prefix-cache salt); the policy must not
    change during the evaluation. `on_task_done` is called as each task finishes (e.g. a progress bar).
    """
    tasks = list(env.tasks(split))[:num_tasks]
    if not tasks:
        raise ValueError(f"environment {env.name!r} has no tasks in split {split!r}")
    ks = list(pass_ks or default_pass_ks(num_samples))
    if not all(1 <= k <= num_samples for k in ks):
        raise ValueError(f"pass@k needs 1 <= k <= num_samples ({num_samples}), got k in {ks}")
    limiter = limiter or WeightedSemaphore(len(tasks) * num_samples)
    evaluate_task = evaluate_multi_turn_task if is_multi_turn(env) else evaluate_single_turn_task
    start = time.perf_counter()

    async def run(task: Task) -> TaskResult:
        result = await evaluate_task(client, env, task, num_samples, sampling, seed, limiter, policy_version)
        if on_task_done is not None:
            on_task_done(result)
        return result

    results = await asyncio.gather(*(run(task) for task in tasks))
    return summarize(env.name, split, seed, results, pass_threshold, ks, time.perf_counter() - start)
