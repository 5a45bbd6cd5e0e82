"""GPT-OSS weights: HF <-> ours, a pure rename (tensors never copied or cast, so a round trip returns the very same
tensors). Attention and norms are renamed as for Llama (with biases) plus `self_attn.sinks` -> `attn.sinks`; the MoE
block keeps transformers' names (`mlp.router.weight`/`bias`, and the experts in their fused layout, which our
experts keep: gpt_oss/experts.py). transformers holds the experts alike in memory and in checkpoints (bf16 ones; the
Hub's MXFP4 checkpoints are dequantized by transformers, not read here)."""

from torch import Tensor

from slipstream.models.common.hf_keys import KeyPairs, attention_pairs, embedding_pairs, prepare_hf, rename_keys
from slipstream.models.gpt_oss.args import GptOssArgs

EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def key_pairs(args: GptOssArgs) -> KeyPairs:
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        hf, ours = f"model.layers.{layer}.", f"layers.{layer}."
        pairs += attention_pairs(args, layer)
        pairs.append((hf + "self_attn.sinks", ours + "attn.sinks"))
        pairs += [(f"{hf}mlp.router.{p}", f"{ours}mlp.router.{p}") for p in ("weight", "bias")]
        pairs += [(f"{hf}mlp.experts.{t}", f"{ours}mlp.experts.{t}") for t in EXPERT_TENSORS]
    return pairs


def from_hf(hf_sd: dict[str, Tensor], args: GptOssArgs) -> dict[str, Tensor]:
    """Our state dict from an HF GPT-OSS state dict (checkpoint or in-memory: the same layout)."""
    return rename_keys(prepare_hf(hf_sd, args), key_pairs(args), to_hf=False, what="gpt_oss from_hf")


def to_hf(sd: dict[str, Tensor], args: GptOssArgs) -> dict[str, Tensor]:
    """HF state dict, what save_pretrained writes (the same tensors)."""
    return rename_keys(sd, key_pairs(args), to_hf=True, what="gpt_oss to_hf")
