"""Typed, documented configuration for every Slipstream process (pydantic, torch-free)."""

from slipstream.config.base import BaseConfig, ConfigError
from slipstream.config.inference import InferenceConfig
from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.config.rl import RLConfig
from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import TrainerConfig

__all__ = [
    "BaseConfig",
    "ConfigError",
    "InferenceConfig",
    "ModelConfig",
    "OrchestratorConfig",
    "RLConfig",
    "TrainerConfig",
]
