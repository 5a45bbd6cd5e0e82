"""GLM-5 (glm_moe_dsa) model arguments, read from a transformers `GlmMoeDsaConfig`, with the checks of what is not
modelled."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import transformer_fields_from_hf
from slipstream.models.glm4_moe.args import Glm4MoeArgs, moe_fields_from_hf


@dataclass(frozen=True, kw_only=True)
class GlmMoeDsaArgs(Glm4MoeArgs):
    """MLA attention: queries through a low-rank bottleneck (`q_a_proj` to `q_lora_rank`, RMSNorm, `q_b_proj` to H
    heads of `qk_nope_head_dim + qk_rope_head_dim`), keys and values from one compressed latent (`kv_a_proj_with_mqa`
    to `kv_lora_rank` + a single shared rope key of `qk_rope_head_dim`, RMSNorm on the latent, `kv_b_proj` to H heads of
    `qk_nope_head_dim` key + `v_head_dim` value dims); RoPE (interleaved pairs) on the rope dims only, so
    `head_dim` (what common/rope.py rotates) is `qk_rope_head_dim`, as transformers sets it.

    DSA: per layer an indexer (`index_n_heads` heads of `index_head_dim`, its own projections) scores every key of a
    query's sample; the query attends to its `index_topk` best keys only (all of them while the sample is shorter).
    The indexer's RoPE is interleaved when the config says `indexer_rope_interleave` (GLM-5's checkpoints do), else
    half-split (NeoX, DeepSeek-V3.2's): vLLM and SGLang read that flag; transformers 5.19 always interleaves.

    MoE as GLM-4.5 (Glm4MoeArgs): the layers `mlp_layer_types` marks "dense" have a SwiGLU of `intermediate_size`,
    the "sparse" ones the shared-expert MoE with sigmoid group-limited routing.

    Not modelled, rejected by `from_hf_config`: indexer layers that reuse another layer's top-k (`indexer_types`
    "shared": transformers' cross-layer top-k sharing), queries without the low-rank bottleneck (`q_lora_rank` None),
    grouped key/value heads (`num_key_value_heads` != heads: MLA expands one latent into every head), RoPE types other
    than common/rope.py's (yarn's attention scaling). Not modelled, dropped on import: multi-token-prediction layers."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int
    """Keys each query attends to (at most)."""
    index_n_heads: int
    index_head_dim: int
    indexer_rope_interleave: bool
    """The indexer rotates interleaved pairs (True) or the two halves of its rope dims (False, the default of vLLM)."""
    mlp_layer_types: tuple[str, ...]
    """"dense" or "sparse" (MoE) per layer."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "GlmMoeDsaArgs":
        _check_glm_moe_dsa_supported(cfg)
        fields = transformer_fields_from_hf(cfg, qk_norm=False)
        fields["head_dim"] = cfg.qk_rope_head_dim  # the rotated dims (transformers sets head_dim to them too)
        fields["mlp_bias"] = False
        return cls(
            **fields,
            **moe_fields_from_hf(cfg),
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            index_topk=cfg.index_topk,
            index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim,
            indexer_rope_interleave=bool(getattr(cfg, "indexer_rope_interleave", False)),
            mlp_layer_types=tuple(cfg.mlp_layer_types),
        )


def _check_glm_moe_dsa_supported(cfg: Any) -> None:
    """Reject GLM-5 config features the custom model does not compute as the checkpoint means."""
    shared = [i for i, t in enumerate(getattr(cfg, "indexer_types", None) or []) if t != "full"]
    if shared:
        raise ValueError(
            f"glm_moe_dsa: indexer_types other than 'full' (layers {shared[:8]} reuse another layer's top-k) are not "
            "supported by the custom model; use impl='hf'"
        )
    if not cfg.q_lora_rank:
        raise ValueError("glm_moe_dsa: q_lora_rank must be set (the indexer reads the query bottleneck); use impl='hf'")
    if (cfg.num_key_value_heads or cfg.num_attention_heads) != cfg.num_attention_heads:
        raise ValueError(
            f"glm_moe_dsa: num_key_value_heads ({cfg.num_key_value_heads}) must equal num_attention_heads "
            f"({cfg.num_attention_heads}): MLA expands its latent into every head"
        )
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise ValueError(
            f"glm_moe_dsa: index_head_dim ({cfg.index_head_dim}) must be >= qk_rope_head_dim ({cfg.qk_rope_head_dim})"
        )
    unknown = sorted(set(cfg.mlp_layer_types) - {"dense", "sparse"})
    if unknown or len(cfg.mlp_layer_types) != cfg.num_hidden_layers:
        raise ValueError(
            f"glm_moe_dsa: mlp_layer_types must give 'dense' or 'sparse' for each of the {cfg.num_hidden_layers} "
            f"layers, got {list(cfg.mlp_layer_types)}"
        )
