"""Arguments shared by the dense decoder-only families, and the checks applied when reading them from an HF config."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.rope import RopeArgs, rope_args_from_hf


@dataclass(frozen=True, kw_only=True)
class TransformerArgs:
    """Shape and numerics of a pre-norm decoder-only transformer (Llama/Qwen3 style).

    Not modelled (rejected or ignored): sliding-window attention (rejected unless the family models it), dropout
    (ignored: RL and SFT here run without it), KV cache (training only; inference is vLLM).
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


def check_supported(
    cfg: Any, *, family: str = "", layer_types: tuple[str, ...] = (), activation: str | None = "silu"
) -> None:
    """Reject HF config features the custom models do not implement, with a message that says what to do.

    `layer_types`: the per-layer attention types the family models; when given, the config must name one of them for
    each layer, and sliding layers need a `sliding_window`. Sliding-window attention is rejected unless
    "sliding_attention" is one of them. `activation`: what the family's MLPs compute (None: the family ignores
    `hidden_act`, GPT-OSS's clamped SwiGLU). `family` prefixes the family's own messages."""
    if activation is not None and getattr(cfg, "hidden_act", activation) != activation:
        raise ValueError(
            f"hidden_act '{cfg.hidden_act}' is not supported by the custom models ({activation} only); use impl='hf'"
        )
    types = list(getattr(cfg, "layer_types", None) or [])
    sliding = getattr(cfg, "use_sliding_window", False) or "sliding_attention" in types
    if sliding and "sliding_attention" not in layer_types:
        raise ValueError("sliding-window attention is not supported by the custom models; use impl='hf'")
    if layer_types and (len(types) != cfg.num_hidden_layers or set(types) - set(layer_types)):
        raise ValueError(
            f"{family}: layer_types {types} must give one of {layer_types} for each of the {cfg.num_hidden_layers} "
            "layers; use impl='hf'"
        )
    if "sliding_attention" in types and not (getattr(cfg, "sliding_window", None) or 0) > 0:
        raise ValueError(
            f"{family}: sliding_attention layers need sliding_window > 0 in the config, got {cfg.sliding_window}"
        )


def transformer_fields_from_hf(
    cfg: Any,
    *,
    qk_norm: bool,
    allow_partial_rotary: bool = False,
    allow_yarn: bool = False,
    family: str = "",
    layer_types: tuple[str, ...] = (),
    activation: str | None = "silu",
    intermediate_size: int | None = None,
    mlp_bias: bool | None = None,
    rope: RopeArgs | None = None,
) -> dict[str, Any]:
    """Keyword arguments of TransformerArgs read from a transformers config (4.x or 5.x), after `check_supported`
    (`family`, `layer_types`, `activation`: see there). Partial RoPE and yarn only for the families that model them
    (`allow_partial_rotary`, `allow_yarn`, see common/rope.py). A family overrides what its config does not hold:
    `intermediate_size` (no dense MLP), `mlp_bias` (no MLP biases: False whatever the config says), `rope` (RoPE
    parameters read otherwise, such as per layer type)."""
    check_supported(cfg, family=family, layer_types=layer_types, activation=activation)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size if intermediate_size is None else intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope=rope or rope_args_from_hf(cfg, allow_partial_rotary=allow_partial_rotary, allow_yarn=allow_yarn),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)) if mlp_bias is None else mlp_bias,
        qk_norm=qk_norm,
        pad_token_id=getattr(cfg, "pad_token_id", None),
        initializer_range=getattr(cfg, "initializer_range", 0.02),
    )
