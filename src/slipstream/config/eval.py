"""Config of `slipstream eval`: score a model folder, or a run's published weights, on an environment split."""

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.inference import InferenceConfig
from slipstream.config.orchestrator import EnvConfig, SamplingConfig
from slipstream.config.shared import ModelConfig

# top-level key -> copied into the `inference` section (the server `slipstream eval` starts itself)
_SHARED_WITH_INFERENCE = ("model", "seed")

# options that `slipstream eval --help` leaves out: set at the top level instead
HELP_SKIP = tuple(f"--inference.{key}" for key in _SHARED_WITH_INFERENCE)


class EvalConfig(BaseConfig):
    """Evaluate a model on an environment split: mean reward, its spread, and pass@k over `num_samples` seeded
    completions (or rollouts, for multi-turn environments) per task. Serves `model.name` (or a run's
    `weights/step_<step>`) with a vLLM server started for the evaluation, on a free port unless inference.port is
    set, or queries an already running server at `inference_url`."""

    shared_keys: ClassVar[dict[str, tuple[str, ...]]] = {key: ("inference",) for key in _SHARED_WITH_INFERENCE}

    model: ModelConfig
    """Model to evaluate (for a run's step: the run's model, which names the served weights).
    With `run_dir` and `step` >= 1 the run's published weights are served instead of this model's folder."""

    env: EnvConfig = EnvConfig()
    """Environment whose tasks and rewards are used; give a run's `env.args` to get the run's split."""

    split: str = "eval"
    """Split of the environment to evaluate (held-out tasks are in `eval`)."""

    num_tasks: int | None = Field(None, ge=1)
    """Evaluate only the first `num_tasks` tasks of the split. None: all of them."""

    num_samples: int = Field(1, ge=1)
    """Samples per task (n of pass@k); pass@k is reported for k = 1, 2, 4, ... below n, and n."""

    pass_threshold: float = 1.0
    """A sample counts as solved for pass@k when its reward is >= this (1.0: reward 1.0 means solved).
    For reverse_text, 1.0 is an exact reversal; lower it for partial credit."""

    sampling: SamplingConfig = SamplingConfig()
    """Temperature, top_p and max_tokens of the evaluation completions."""

    seed: int = 0
    """Seed of the evaluation: task requests carry seeds derived from it and the task id.
    A rerun with the same seed, model and server settings samples the same completions."""

    seed_requests: bool = True
    """Send the per-task seeds (false: unseeded requests, not reproducible).
    Set false for a server at `inference_url` that is a CPU vLLM build with chunked prefill on: vLLM 0.32 CPU
    crashes on seeded requests whose prompt is prefilled in chunks. The server `slipstream eval` starts itself
    runs without chunked prefill."""

    output_path: Path | None = None
    """JSON results file (default: `<run_dir>/eval/step_<step>.json` for a run's step, else none).
    It holds the summary, the config, and per-task rewards and completions; the summary is printed either way."""

    inference_url: str | None = None
    """Base URL of a running vLLM server serving `model.name` (None: start one for the evaluation).
    The started server (see `inference`) is stopped, with all its processes, when the evaluation ends."""

    inference: InferenceConfig
    """The vLLM server started when `inference_url` is None (`model` and `seed` come from the top level). Its
    port is a free one unless `inference.port` is set."""

    run_dir: Path | None = None
    """Run directory whose published weights to evaluate (with `step`)."""

    step: int | None = Field(None, ge=0)
    """Evaluate `run_dir/weights/step_<step>` (0: the run's initial model, `model.name`)."""

    max_concurrent_requests: int = Field(64, ge=1)
    """Most completions in flight at once."""

    request_timeout_s: float = Field(600.0, gt=0.0)
    """Timeout of one request (it includes time queued in the server)."""

    health_timeout_s: float = Field(600.0, gt=0.0)
    """How long to wait for the inference server to become healthy."""

    @model_validator(mode="before")
    @classmethod
    def _share_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        sub = dict(data.get("inference") or {})
        for key in _SHARED_WITH_INFERENCE:
            value = data.get(key, 0 if key == "seed" else None)
            if value is None:
                continue
            if key in sub and _norm(sub[key]) != _norm(value):
                raise ValueError(f"inference.{key} differs from the top-level {key}; set {key} once at the top level")
            sub[key] = value
        data["inference"] = sub
        return data

    @model_validator(mode="after")
    def _check_run(self) -> "EvalConfig":
        if (self.run_dir is None) != (self.step is None):
            raise ValueError(
                "run_dir and step go together: set both to evaluate a run's weights, or neither to evaluate model.name"
            )
        if self.step is not None and self.inference_url is not None:
            raise ValueError(
                "evaluating a run's step starts its own vLLM server on the run's weights; remove inference_url, "
                "or remove run_dir and step to evaluate the model served at inference_url"
            )
        return self

    @property
    def resolved_output_path(self) -> Path | None:
        """Where results are written: `output_path`, else `<run_dir>/eval/step_<step>.json` for a run's step."""
        if self.output_path is not None:
            return self.output_path
        if self.run_dir is not None:
            return self.run_dir / "eval" / f"step_{self.step}.json"
        return None


def _norm(value: Any) -> Any:
    return value.model_dump() if isinstance(value, ModelConfig) else value
