"""Config of the trainer: optimizer, loss, device and timeouts."""

from pathlib import Path
from typing import Literal

from pydantic import Field

from slipstream.config.base import BaseConfig
from slipstream.config.shared import ModelConfig


class OptimConfig(BaseConfig):
    """AdamW with gradient-norm clipping."""

    lr: float = Field(1e-6, gt=0.0)
    """Learning rate."""

    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""

    eps: float = Field(1e-8, gt=0.0)
    """Adam epsilon."""

    max_grad_norm: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""


class LossConfig(BaseConfig):
    """Default RL loss: DPPO binary trust-region mask + squared log-ratio penalty (see trainer/loss.py)."""

    dp_threshold: float = Field(0.2, gt=0.0)
    """Mask a token when its probability moved by more than this in the direction its advantage pushes."""

    kl_coef: float = Field(1e-3, ge=0.0)
    """Weight of the squared log-ratio (trainer vs inference) penalty."""


class ProbeConfig(BaseConfig):
    """A fixed prompt whose log-probs the trainer publishes with every weight update, to verify the sync."""

    text: str = "Reverse the text: hello world. Answer: dlrow olleh"
    """Probe text; it is tokenized with the model's tokenizer."""


class TrainerConfig(BaseConfig):
    """Trains the policy on the orchestrator's batches and publishes weights."""

    model: ModelConfig
    """Model to train (initial weights)."""

    output_dir: Path
    """Run directory."""

    max_steps: int = Field(ge=1)
    """Number of optimizer steps."""

    seed: int = 0
    """Seed of the trainer's RNG."""

    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    probe: ProbeConfig = ProbeConfig()

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training device; auto picks CUDA when available."""

    num_threads: int | None = Field(None, ge=1)
    """torch CPU threads per rank (default: torch's choice)."""

    batch_timeout_s: float = Field(3600.0, gt=0.0)
    """How long to wait for the orchestrator's batch of a step."""
