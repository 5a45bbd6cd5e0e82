"""Nemotron-H model arguments, read from a transformers `NemotronHConfig` (with the checks of what is not modelled)."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs
from slipstream.models.common.rope import RopeArgs

LAYER_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
"""transformers' names of the four block kinds: Mamba2, attention, dense MLP, MoE (pattern letters M, *, -, E)."""


@dataclass(frozen=True, kw_only=True)
class NemotronHArgs(TransformerArgs):
    """Each layer is ONE mixer behind a pre-norm and a residual (`x + mixer(norm(x))`), of the kind
    `layer_types[i]` names:
    - "linear_attention": a Mamba2 layer (`mamba_num_heads` heads of `mamba_head_dim`, B/C of `ssm_state_size`
      shared by `mamba_n_groups` groups of heads, a causal depthwise conv of `conv_kernel` taps, dt clamped below at
      `time_step_min`, a gated RMSNorm per group; ssd.py);
    - "full_attention": GQA without positional encoding (Nemotron-H's attention layers use no RoPE), no biases;
    - "mlp": `down(relu(up(x))^2)` of width `intermediate_size`;
    - "moe": `num_experts` squared-ReLU experts of `moe_intermediate_size` (optionally in a `moe_latent_size` latent
      space), sigmoid scores, group-limited top-A on `scores + e_score_correction_bias`, gates renormalised
      (`norm_topk_prob`) and scaled by `routed_scaling_factor`, plus a shared squared-ReLU expert of
      `shared_expert_intermediate_size`.

    `rope` is unused (no layer rotates). `tie_word_embeddings` is always False and `pad_token_id` None: transformers'
    NemotronH never ties its head (its checkpoints hold `lm_head.weight` even when the config says tied) and its
    embedding has no padding row. `attention_bias` is False: transformers' attention has no biases whatever the
    config says.

    Not modelled, rejected by `from_hf_config`: activations other than relu2 (MLP) and silu (Mamba), unknown layer
    types. Ignored: dropout, `residual_in_fp32` (transformers ignores it too), multi-token-prediction layers (`mtp.*`
    weights, dropped on import), context parallelism (model.py says why)."""

    layer_types: tuple[str, ...]
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    mamba_n_groups: int
    """Groups of Mamba heads sharing one B and one C (and one group of the gated norm)."""
    conv_kernel: int
    use_conv_bias: bool
    mamba_bias: bool
    """Biases on the Mamba `in_proj`/`out_proj` (transformers' `use_bias`)."""
    time_step_min: float
    """Lower clamp of dt after softplus (transformers clamps dt to [time_step_min, inf))."""
    chunk_size: int
    """Tokens per chunk of the SSD scan (a compute choice: the result does not depend on it)."""
    num_experts: int
    """E: routed experts."""
    num_experts_per_tok: int
    """A: routed experts per token."""
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    moe_latent_size: int | None
    """Experts run in this width between `fc1_latent_proj` and `fc2_latent_proj` (None: the hidden size)."""
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.layer_types[layer] == "moe"

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "NemotronHArgs":
        _check_nemotron_h_supported(cfg)
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=len(cfg.layers_block_type),
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.layer_norm_epsilon,
            rope=RopeArgs(theta=10000.0),
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=bool(cfg.mlp_bias),
            qk_norm=False,
            pad_token_id=None,
            initializer_range=getattr(cfg, "initializer_range", 0.02),
            layer_types=tuple(cfg.layers_block_type),
            mamba_num_heads=cfg.mamba_num_heads,
            mamba_head_dim=cfg.mamba_head_dim,
            ssm_state_size=cfg.ssm_state_size,
            mamba_n_groups=cfg.n_groups,
            conv_kernel=cfg.conv_kernel,
            use_conv_bias=bool(cfg.use_conv_bias),
            mamba_bias=bool(cfg.use_bias),
            time_step_min=float(cfg.time_step_min),
            chunk_size=int(cfg.chunk_size),
            num_experts=cfg.n_routed_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_latent_size=cfg.moe_latent_size,
            num_groups=int(cfg.n_group or 1),
            topk_groups=int(cfg.topk_group or 1),
            norm_topk_prob=bool(cfg.norm_topk_prob),
            routed_scaling_factor=float(cfg.routed_scaling_factor),
        )


def _check_nemotron_h_supported(cfg: Any) -> None:
    """Reject Nemotron-H config features that our model does not compute as transformers does."""
    if getattr(cfg, "mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(
            f"nemotron_h: mlp_hidden_act '{cfg.mlp_hidden_act}' is not supported (relu2 only); use impl='hf'"
        )
    if getattr(cfg, "mamba_hidden_act", "silu") != "silu":
        raise ValueError(
            f"nemotron_h: mamba_hidden_act '{cfg.mamba_hidden_act}' is not supported (silu only); use impl='hf'"
        )
    types = list(cfg.layers_block_type or [])
    if not types or set(types) - set(LAYER_TYPES):
        raise ValueError(f"nemotron_h: layers_block_type must list one of {LAYER_TYPES} per layer, got {types}")
    if cfg.mamba_num_heads % cfg.n_groups != 0:
        raise ValueError(f"nemotron_h: n_groups ({cfg.n_groups}) must divide mamba_num_heads ({cfg.mamba_num_heads})")
    if cfg.num_attention_heads % (cfg.num_key_value_heads or cfg.num_attention_heads) != 0:
        raise ValueError(
            f"nemotron_h: num_key_value_heads ({cfg.num_key_value_heads}) must divide num_attention_heads "
            f"({cfg.num_attention_heads})"
        )
