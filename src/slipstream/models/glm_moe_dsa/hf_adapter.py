"""GLM-5 (glm_moe_dsa) weights: HF <-> ours. Norms and the MLA projections keep transformers' names under
`self_attn` -> `attn` (the indexer's too: `attn.indexer.{wq_b,wk,k_norm,weights_proj}`); MLP and MoE keys are
GLM-4.5's (`mlp.gate` -> `mlp.router`, shared experts, routed experts stacked into [E, ...] from either HF layout,
common/hf_experts.py). Multi-token-prediction layers (`model.layers.{i}.*` for i >= num_layers) are dropped on
import and absent on export."""

from functools import partial

from torch import Tensor

from slipstream.models.common.hf_experts import moe_from_hf, moe_to_hf
from slipstream.models.common.hf_keys import KeyPairs, embedding_pairs
from slipstream.models.glm4_moe.hf_adapter import mlp_pairs, moe_layers
from slipstream.models.glm_moe_dsa.args import GlmMoeDsaArgs

_BIASED = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
"""The projections that carry a bias when `attention_bias`."""
_ATTENTION = ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", *_BIASED)
_INDEXER = ("indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
            "indexer.weights_proj.weight")  # fmt: skip


def mla_pairs(args: GlmMoeDsaArgs, layer: int) -> KeyPairs:
    """Both norms of block `layer`, its MLA projections and its indexer."""
    hf, ours = f"model.layers.{layer}.", f"layers.{layer}."
    pairs = [
        (hf + "input_layernorm.weight", ours + "attn_norm.weight"),
        (hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight"),
    ]
    names = [f"{m}.weight" for m in _ATTENTION] + list(_INDEXER)
    if args.attention_bias:
        names += [f"{m}.bias" for m in _BIASED]
    return pairs + [(f"{hf}self_attn.{n}", f"{ours}attn.{n}") for n in names]


def non_expert_pairs(args: GlmMoeDsaArgs, buffers: bool = True) -> KeyPairs:
    """All keys but the routed experts'; without the routers' `e_score_correction_bias` buffers if not `buffers`."""
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += mla_pairs(args, layer) + mlp_pairs(args, layer, buffers)
    return pairs


def from_hf(hf_sd: dict[str, Tensor], args: GlmMoeDsaArgs) -> dict[str, Tensor]:
    """Our state dict from an HF GLM-5 state dict (checkpoint or transformers' in-memory layout), nothing cast; a
    dict of parameters only (gradients) converts too, without the buffers."""
    pairs = partial(non_expert_pairs, args)
    return moe_from_hf(hf_sd, args, pairs=pairs, moe_layers=moe_layers(args), what="glm_moe_dsa from_hf")


def to_hf(sd: dict[str, Tensor], args: GlmMoeDsaArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict, experts per expert as views of our [E, ...] tensors (clone before save_file)."""
    return moe_to_hf(sd, pairs=non_expert_pairs(args), moe_layers=moe_layers(args), what="glm_moe_dsa to_hf")
