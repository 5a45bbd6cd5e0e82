"""Config of the orchestrator: rollouts, rewards, advantages, batching and policy-version bookkeeping."""

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.shared import ModelConfig


class SamplingConfig(BaseConfig):
    """Sampling parameters of rollouts."""

    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature. Trainer log-probs are computed at this temperature too."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling. Keep 1.0 for RL: the loss assumes the full temperature-scaled distribution."""

    max_tokens: int = Field(128, ge=1)
    """Most completion tokens per rollout."""


class EnvConfig(BaseConfig):
    """Which environment produces tasks and rewards."""

    name: str = "reverse_text"
    """Registered environment name (see `slipstream.envs.registry`)."""

    args: dict[str, Any] = {}
    """Keyword arguments for the environment's constructor (e.g. `num_tasks`, `min_words`)."""


class AdvantageConfig(BaseConfig):
    """GRPO advantages: reward minus the group's mean reward."""

    std_normalize: bool = False
    """Divide by the group's reward standard deviation (Dr. GRPO recommends off)."""


class WeightCheckConfig(BaseConfig):
    """Verification of every weight update against the trainer's log-probs on a probe prompt."""

    enabled: bool = True
    """Score the trainer's probe on inference after each weight load and compare."""

    max_abs_diff: float | None = Field(None, gt=0.0)
    """Largest allowed |trainer - inference| log-prob difference on probe tokens. Default: 1e-3 for float32
    models, 5e-2 for bfloat16 (different kernels round differently at bf16)."""

    stop_on_failure: bool = True
    """Stop the run when a check fails: a frozen or corrupted policy must not train silently."""


class OrchestratorConfig(BaseConfig):
    """Drives rollouts against inference and writes training batches."""

    model: ModelConfig
    """Model served by inference (its name is sent with every request)."""

    output_dir: Path
    """Run directory (`rollouts/`, `weights/`, `metrics.jsonl`, ...)."""

    max_steps: int = Field(ge=1)
    """Number of training steps (one batch each)."""

    seed: int = 0
    """Seed of task sampling."""

    inference_url: str = "http://127.0.0.1:8000"
    """Base URL of the vLLM server."""

    batch_size: int = Field(16, ge=1)
    """Rollouts per training step."""

    group_size: int = Field(4, ge=1)
    """Rollouts per task (GRPO group); must divide batch_size."""

    max_async_level: int = Field(1, ge=0)
    """How many policy versions the rollouts of a step may lag behind the trainer. 0 = synchronous."""

    max_concurrent_requests: int = Field(64, ge=1)
    """Most rollout requests in flight at once."""

    micro_batch_tokens: int = Field(8192, ge=16)
    """Token budget of one packed training micro-batch."""

    num_trainer_ranks: int = Field(1, ge=1)
    """Number of trainer ranks; each gets its own list of micro-batches."""

    sampling: SamplingConfig = SamplingConfig()
    env: EnvConfig = EnvConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    weight_check: WeightCheckConfig = WeightCheckConfig()

    request_timeout_s: float = Field(600.0, gt=0.0)
    """Timeout of one inference request."""

    weights_timeout_s: float = Field(3600.0, gt=0.0)
    """How long to wait for the trainer to publish the weights a step needs."""

    health_timeout_s: float = Field(600.0, gt=0.0)
    """How long to wait for the inference server to become healthy."""

    @property
    def weight_check_tolerance(self) -> float:
        """The weight check's max |diff|, defaulted by the model dtype."""
        if self.weight_check.max_abs_diff is not None:
            return self.weight_check.max_abs_diff
        return 1e-3 if self.model.dtype == "float32" else 5e-2

    @model_validator(mode="after")
    def _check_group(self) -> "OrchestratorConfig":
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size}); "
                f"change orchestrator.batch_size to {self.batch_size // self.group_size * self.group_size or self.group_size}"
            )
        return self
