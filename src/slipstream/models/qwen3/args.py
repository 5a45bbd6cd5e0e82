"""Qwen3 (dense) model arguments, read from a transformers `Qwen3Config`."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs, transformer_fields_from_hf


@dataclass(frozen=True, kw_only=True)
class Qwen3Args(TransformerArgs):
    """Qwen3: q/k RMSNorm on; no MLP bias; sliding-window configs are rejected (released Qwen3s do not use it)."""

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "Qwen3Args":
        fields = transformer_fields_from_hf(cfg, qk_norm=True)
        fields["mlp_bias"] = False  # Qwen3MLP has no bias whatever the config holds
        return cls(**fields)
