"""GPT-OSS model arguments, read from a transformers `GptOssConfig` (with the checks of what is not modelled)."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs
from slipstream.models.common.rope import rope_args_from_hf

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class GptOssArgs(TransformerArgs):
    """GQA attention with q/k/v/o biases (`attention_bias`), a learned sink logit per query head, and per layer either
    causal attention over the last `sliding_window` tokens of the sample or full causal attention (`layer_types`);
    YaRN RoPE. Every layer is an MoE of `num_experts` experts of width `intermediate_size` with biases and GPT-OSS's
    clamped SwiGLU `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`, g = `clamp(gate, max=l)`; the router is a biased
    linear layer, top-A on its logits, the gate weights the softmax over the A chosen logits.

    Not modelled, rejected by `from_hf_config`: attention dropout (ignored: RL and SFT here run without it), layer
    types other than sliding/full attention."""

    num_experts: int
    """E (`num_local_experts`)."""
    num_experts_per_tok: int
    """A: routed experts per token."""
    router_aux_loss_coef: float
    """From the config, for a trainer that chooses to add the aux loss; the model never adds it."""
    sliding_window: int
    """W: a sliding layer's query sees keys of its own sample at most W - 1 positions back."""
    layer_types: tuple[str, ...]
    """Per layer: "sliding_attention" or "full_attention"."""
    swiglu_alpha: float
    swiglu_limit: float

    @property
    def moe_intermediate_size(self) -> int:
        """F of one expert (transformers' `intermediate_size`)."""
        return self.intermediate_size

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "GptOssArgs":
        layer_types = tuple(cfg.layer_types)
        if len(layer_types) != cfg.num_hidden_layers or any(t not in LAYER_TYPES for t in layer_types):
            raise ValueError(
                f"gpt_oss: layer_types {list(layer_types)} must give one of {LAYER_TYPES} per layer "
                f"({cfg.num_hidden_layers} layers)"
            )
        if "sliding_attention" in layer_types and not cfg.sliding_window:
            raise ValueError("gpt_oss: sliding_attention layers need a sliding_window > 0 in the config")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope=rope_args_from_hf(cfg, allow_yarn=True),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(cfg, "attention_bias", True)),
            mlp_bias=False,
            qk_norm=False,
            pad_token_id=getattr(cfg, "pad_token_id", None),
            initializer_range=getattr(cfg, "initializer_range", 0.02),
            num_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
            sliding_window=int(cfg.sliding_window or 0),
            layer_types=layer_types,
            swiglu_alpha=float(cfg.swiglu_alpha),
            swiglu_limit=float(cfg.swiglu_limit),
        )
