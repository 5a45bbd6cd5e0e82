"""Config pieces shared by several processes."""

from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig


class ModelConfig(BaseConfig):
    """Which model to train and serve."""

    name: str
    """A local Hugging Face model folder, or a known alias such as `smollm2-135m-instruct`
    (imported on first use into the model cache, see `slipstream model import`)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype inference serves and weights are published in; also the trainer's compute dtype (its master
    weights and optimizer state stay float32). float32 keeps CPU runs exact; use bfloat16 on GPUs."""


class CheckpointConfig(BaseConfig):
    """Whole-run checkpoints in `output_dir/checkpoints/step_N/`: the trainer's model, optimizer and RNG (DCP) and
    the orchestrator's data position, committed together by one `step_N/COMMITTED` marker (see
    slipstream.transport.checkpoints). `slipstream rl --resume` continues from the newest committed one."""

    interval: int | None = Field(None, ge=1)
    """Checkpoint every this many steps and at the last step; None: never."""

    keep_last: int | None = Field(None, ge=1)
    """Keep only the newest this many committed checkpoints (plus those `keep_every` keeps); None: keep all. The
    newest committed checkpoint and checkpoints still being written are never deleted."""

    keep_every: int | None = Field(None, ge=1)
    """With keep_last: also keep the checkpoints of steps divisible by this (e.g. 100 keeps step_100, step_200)."""

    @model_validator(mode="after")
    def _check_retention(self) -> "CheckpointConfig":
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError(
                "checkpoint.keep_every only matters with checkpoint.keep_last (without it every checkpoint is kept); "
                "set checkpoint.keep_last too, or drop keep_every"
            )
        return self
