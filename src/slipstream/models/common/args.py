"""Arguments shared by the dense decoder-only families, and the checks applied when reading them from an HF config."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.rope import RopeArgs, rope_args_from_hf


@dataclass(frozen=True, kw_only=True)
class TransformerArgs:
    """Shape and numerics of a pre-norm decoder-only transformer (Llama/Qwen3 style).

    Not modelled (rejected or ignored): sliding-window attention (rejected), dropout (ignored: RL and SFT here run
    without it), KV cache (training only; inference is vLLM).
    """

    vocab_size: int
    hidden_size: int
    """D: model (residual stream) width."""
    intermediate_size: int
    """F of the dense SwiGLU MLP."""
    num_layers: int
    num_heads: int
    """H: query heads."""
    num_kv_heads: int
    """G: key/value heads (G divides H)."""
    head_dim: int
    """K: width of one head."""
    rms_norm_eps: float
    rope: RopeArgs
    tie_word_embeddings: bool
    """The LM head reuses the input embedding matrix (SmolLM2, small Qwen3s)."""
    attention_bias: bool
    """Biases on q/k/v/o projections."""
    mlp_bias: bool
    """Biases on the dense MLP projections (Llama's `mlp_bias`)."""
    qk_norm: bool
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    pad_token_id: int | None
    """Embedding row that gets no gradient, as in transformers' `nn.Embedding(padding_idx=pad_token_id)`."""
    initializer_range: float = 0.02
    """Std of the normal init of fresh (not loaded) weights."""


def check_supported(cfg: Any) -> None:
    """Reject HF config features the custom models do not implement, with a message that says what to do."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"hidden_act '{cfg.hidden_act}' is not supported by the custom models (silu only); use impl='hf'"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError("sliding-window attention is not supported by the custom models; use impl='hf'")


def transformer_fields_from_hf(cfg: Any, *, qk_norm: bool, allow_partial_rotary: bool = False) -> dict[str, Any]:
    """Keyword arguments of TransformerArgs read from a transformers config (4.x or 5.x); partial RoPE only for the
    families that model it (`allow_partial_rotary`, see common/rope.py)."""
    check_supported(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope=rope_args_from_hf(cfg, allow_partial_rotary=allow_partial_rotary),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=qk_norm,
        pad_token_id=getattr(cfg, "pad_token_id", None),
        initializer_range=getattr(cfg, "initializer_range", 0.02),
    )
