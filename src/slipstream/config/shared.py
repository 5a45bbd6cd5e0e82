"""Config pieces shared by several processes."""

from typing import Literal

from slipstream.config.base import BaseConfig


class ModelConfig(BaseConfig):
    """Which model to train and serve."""

    name: str
    """A local Hugging Face model folder, or a known alias such as `smollm2-135m-instruct`
    (imported on first use into the model cache, see `slipstream model import`)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype inference serves and weights are published in; also the trainer's compute dtype (its master
    weights and optimizer state stay float32). float32 keeps CPU runs exact; use bfloat16 on GPUs."""
