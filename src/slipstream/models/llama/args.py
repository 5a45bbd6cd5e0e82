"""Llama model arguments, read from a transformers `LlamaConfig`."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs, transformer_fields_from_hf


@dataclass(frozen=True, kw_only=True)
class LlamaArgs(TransformerArgs):
    """Llama: no q/k norm; attention and MLP biases as the config says; tied embeddings possible (SmolLM2)."""

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "LlamaArgs":
        return cls(**transformer_fields_from_hf(cfg, qk_norm=False))
