"""`slipstream eval`: serve the model (or use a running server), evaluate with a progress bar, write JSON results."""

import asyncio
import json
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from slipstream.config.eval import EvalConfig
from slipstream.envs.base import AnyEnvironment
from slipstream.envs.registry import build_env
from slipstream.eval.evaluate import evaluate
from slipstream.eval.results import EvalResult, TaskResult
from slipstream.orchestrator.client import InferenceClient
from slipstream.rollout.limiter import WeightedSemaphore
from slipstream.rundir import RunDir
from slipstream.utils.fs import atomic_write_text


def eval_command(config: EvalConfig) -> int:
    """CLI entry point: run the evaluation, return exit code 0 (errors raise)."""
    from slipstream.monitor.logs import setup_logging

    setup_logging("eval")  # warnings of the shared rollout code get a timestamp and level, as in the other processes
    run_eval(config)
    return 0


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Evaluate `config.model` (or a run's step) on `config.env`'s split; return the results written to JSON."""
    env = build_env(config.env.name, **config.env.args)
    env.tasks(config.split)  # an unknown split fails here, before a server is started
    model_path: Path | None = None
    if config.inference_url is not None:
        result = asyncio.run(_evaluate_at(config, env, config.inference_url))
    else:
        from slipstream.eval.server import serve_model
        from slipstream.utils.net import free_port

        model_path = resolve_eval_model(config)
        inference = config.inference
        if "port" not in inference.model_fields_set:
            inference = inference.model_copy(update={"port": free_port()})
        log_path = _server_log_path(config)
        _say(f"starting vLLM on {model_path} at {inference.url} (log: {log_path})")
        with serve_model(inference, model_path, log_path, config.health_timeout_s) as url:
            result = asyncio.run(_evaluate_at(config, env, url))
    results = {
        "model": config.model.name,
        "model_path": None if model_path is None else str(model_path),
        "run_dir": None if config.run_dir is None else str(config.run_dir),
        "step": config.step,
        **result.to_dict(),
        "config": config.model_dump(mode="json"),
    }
    _say(format_summary(result))
    output_path = config.resolved_output_path
    if output_path is not None:
        atomic_write_text(output_path, json.dumps(results, indent=1) + "\n")
        _say(f"results written to {output_path}")
    return results


async def _evaluate_at(config: EvalConfig, env: AnyEnvironment, url: str) -> EvalResult:
    from tqdm import tqdm

    num_tasks = len(env.tasks(config.split)[: config.num_tasks])
    async with InferenceClient(url, config.model.name, config.request_timeout_s) as client:
        await client.wait_healthy(config.health_timeout_s)
        with tqdm(total=num_tasks, desc=f"eval {env.name}/{config.split}", unit="task", file=sys.stderr) as bar:
            rewards: list[float] = []

            def on_task_done(task: TaskResult) -> None:
                rewards.extend(task.rewards)
                bar.set_postfix(reward=f"{sum(rewards) / len(rewards):.3f}", refresh=False)
                bar.update(1)

            return await evaluate(
                client,
                env,
                config.split,
                config.num_samples,
                config.sampling,
                config.seed if config.seed_requests else None,
                WeightedSemaphore(config.max_concurrent_requests),
                num_tasks=config.num_tasks,
                pass_threshold=config.pass_threshold,
                on_task_done=on_task_done,
            )


def resolve_eval_model(config: EvalConfig) -> Path:
    """The folder to serve: the run's `weights/step_<step>` (step >= 1), else `model.name` resolved."""
    from slipstream.models.resolve import resolve_model_config
    from slipstream.weights.wire.published import READY, latest_ready_step

    if config.run_dir is None or config.step is None:
        return resolve_model_config(config.model)
    if not config.run_dir.is_dir():
        raise FileNotFoundError(f"run_dir {config.run_dir} does not exist")
    check_run_model(config.run_dir, config.model.name)
    if config.step == 0:
        return resolve_model_config(config.model)
    path = RunDir(config.run_dir).weights_dir(config.step)
    if not (path / READY).exists():
        latest = latest_ready_step(config.run_dir)
        raise FileNotFoundError(
            f"{path} is not a complete published weights folder (no {READY} marker); "
            f"the newest published step of this run is {latest}"
        )
    return path


def check_run_model(run_dir: Path, model_name: str) -> None:
    """Refuse a `model.name` other than the run's (from its `config/inference.toml`, when the run wrote one)."""
    path = RunDir(run_dir).config_path("inference")
    if not path.exists():
        return
    run_model = tomllib.loads(path.read_text()).get("model", {}).get("name")
    if run_model is not None and run_model != model_name:
        raise ValueError(f"model.name {model_name!r} is not the model of run {run_dir} ({run_model!r}, from {path})")


def _server_log_path(config: EvalConfig) -> Path:
    """`<run_dir>/logs/eval_step_<N>_inference.log`, else beside the results file, else in a new temp folder."""
    if config.run_dir is not None:
        return RunDir(config.run_dir).log_path(f"eval_step_{config.step}_inference")
    if config.output_path is not None:
        return config.output_path.with_name(f"{config.output_path.stem}.inference.log")
    return Path(tempfile.mkdtemp(prefix="slipstream-eval-")) / "inference.log"


def format_summary(result: EvalResult) -> str:
    """E.g. `reverse_text/eval: 64 tasks x 4 samples | reward 0.312 ± 0.21 (stderr 0.02) | pass@1 0.05 | 41s`."""
    passes = " ".join(f"pass@{k} {v:.3f}" for k, v in result.pass_at_k.items())
    errors = f" | {result.num_errors} failed rollouts (scored 0)" if result.num_errors else ""
    return (
        f"{result.env}/{result.split}: {result.num_tasks} tasks x {result.num_samples} samples | "
        f"reward {result.reward_mean:.3f} ± {result.reward_std:.3f} (stderr {result.reward_stderr:.3f}) | "
        f"{passes} (reward >= {result.pass_threshold:g}) | {result.completion_tokens_mean:.0f} tokens{errors} | "
        f"{result.seconds:.0f}s"
    )


def _say(message: str) -> None:
    print(f"[eval] {message}", flush=True)
