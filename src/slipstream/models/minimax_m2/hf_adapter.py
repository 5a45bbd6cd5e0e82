"""MiniMax-M2 weights: HF <-> ours. Attention and norms are renamed as for Qwen3 (q/k norms of full width), the MoE
block (`block_sparse_moe` in checkpoints, `mlp` in transformers 5.x's memory) becomes `mlp`: `gate.weight` ->
`router.weight`, the block's `e_score_correction_bias` -> `router.e_score_correction_bias`, and the experts
(`experts.{e}.w1/w3/w2.weight` = gate/up/down in checkpoints, fused `gate_up_proj`/`down_proj` in memory) are stacked
into [E, ...] tensors (common/hf_experts.py). Export writes the checkpoint layout (what save_pretrained writes and vLLM
loads). Multi-token-prediction modules of the checkpoint (`model.layers.{i}.*` for i >= num_layers) are dropped on
import."""

from torch import Tensor

from slipstream.models.common.hf_experts import moe_from_hf, moe_to_hf, sigmoid_moe_pairs
from slipstream.models.common.hf_keys import KeyPairs, attention_pairs, embedding_pairs
from slipstream.models.minimax_m2.args import MiniMaxM2Args

CHECKPOINT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
"""Our expert projections -> the names MiniMax-M2 checkpoints give them."""


def non_expert_pairs(args: MiniMaxM2Args, moe: str, buffers: bool = True) -> KeyPairs:
    """All keys but the routed experts', with the MoE block named `moe` (`block_sparse_moe` or `mlp`); without the
    `e_score_correction_bias` buffers if not `buffers`."""
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += attention_pairs(args, layer)
        hf, ours = f"model.layers.{layer}.{moe}.", f"layers.{layer}.mlp."
        pairs += sigmoid_moe_pairs(hf, ours, "e_score_correction_bias", buffers, shared_experts=False)
    return pairs


def from_hf(hf_sd: dict[str, Tensor], args: MiniMaxM2Args) -> dict[str, Tensor]:
    """Our state dict from an HF MiniMax-M2 state dict: a checkpoint (`block_sparse_moe`, per-expert w1/w2/w3) or
    transformers 5.x's in-memory one (`mlp`, fused `gate_up_proj`); renamed and stacked, nothing cast. A dict of
    parameters only (gradients: no `e_score_correction_bias` buffer) converts too, without the buffers."""
    moe = "block_sparse_moe" if any(".block_sparse_moe." in k for k in hf_sd) else "mlp"
    return moe_from_hf(
        hf_sd,
        args,
        pairs=lambda buffers: non_expert_pairs(args, moe, buffers),
        moe_layers=list(range(args.num_layers)),
        hf_block=moe,
        names=CHECKPOINT_NAMES,
        what="minimax_m2 from_hf",
    )


def to_hf(sd: dict[str, Tensor], args: MiniMaxM2Args) -> dict[str, Tensor]:
    """HF checkpoint state dict (`block_sparse_moe`, experts per expert as w1/w2/w3: views of our [E, ...] tensors,
    clone before save_file)."""
    return moe_to_hf(
        sd,
        pairs=non_expert_pairs(args, "block_sparse_moe"),
        moe_layers=list(range(args.num_layers)),
        hf_block="block_sparse_moe",
        names=CHECKPOINT_NAMES,
        what="minimax_m2 to_hf",
    )
