"""GPT-OSS model arguments, read from a transformers `GptOssConfig` (with the checks of what is not modelled)."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs, transformer_fields_from_hf

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
        fields = transformer_fields_from_hf(
            cfg,
            qk_norm=False,
            allow_yarn=True,
            family="gpt_oss",
            layer_types=LAYER_TYPES,
            activation=None,
            mlp_bias=False,
        )
        return cls(
            **fields,
            num_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
            sliding_window=int(cfg.sliding_window or 0),
            layer_types=tuple(cfg.layer_types),
            swiglu_alpha=float(cfg.swiglu_alpha),
            swiglu_limit=float(cfg.swiglu_limit),
        )
