"""Hugging Face <-> Slipstream state-dict key tables for decoder-only models, with strict key checks.

Conversions only rename (MoE adapters also stack/unstack experts): tensors are never copied or cast, so a round
trip HF -> ours -> HF returns the very same tensors.
"""

from torch import Tensor

from slipstream.models.common.args import TransformerArgs

KeyPairs = list[tuple[str, str]]
"""(HF key, our key) pairs."""


def embedding_pairs(args: TransformerArgs) -> KeyPairs:
    pairs = [("model.embed_tokens.weight", "embed_tokens.weight"), ("model.norm.weight", "norm.weight")]
    if not args.tie_word_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    return pairs


def attention_pairs(args: TransformerArgs, layer: int) -> KeyPairs:
    """Both norms of block `layer` and its attention (projections, optional biases, optional q/k norms)."""
    hf, ours = f"model.layers.{layer}.", f"layers.{layer}."
    pairs = [
        (hf + "input_layernorm.weight", ours + "attn_norm.weight"),
        (hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight"),
    ]
    params = ["weight", "bias"] if args.attention_bias else ["weight"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        pairs += [(f"{hf}self_attn.{proj}.{p}", f"{ours}attn.{proj}.{p}") for p in params]
    if args.qk_norm:
        pairs += [(f"{hf}self_attn.{n}.weight", f"{ours}attn.{n}.weight") for n in ("q_norm", "k_norm")]
    return pairs


def dense_mlp_pairs(layer: int, bias: bool) -> KeyPairs:
    params = ["weight", "bias"] if bias else ["weight"]
    return [
        (f"model.layers.{layer}.mlp.{proj}.{p}", f"layers.{layer}.mlp.{proj}.{p}")
        for proj in ("gate_proj", "up_proj", "down_proj")
        for p in params
    ]


def dense_key_pairs(args: TransformerArgs) -> KeyPairs:
    """All keys of a dense model (Llama, Qwen3)."""
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += attention_pairs(args, layer) + dense_mlp_pairs(layer, args.mlp_bias)
    return pairs


def prepare_hf(hf_sd: dict[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """Drop what is not a weight of ours: derived RoPE buffers (old checkpoints) and, when tied, an `lm_head.weight`
    that must equal the embedding (in-memory HF state dicts list the tied tensor under both names)."""
    hf_sd = {k: v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if args.tie_word_embeddings and "lm_head.weight" in hf_sd:
        head, embed = hf_sd.pop("lm_head.weight"), hf_sd.get("model.embed_tokens.weight")
        if embed is None or head.shape != embed.shape or not head.equal(embed):
            raise ValueError(
                "config says tie_word_embeddings=True but lm_head.weight differs from "
                "model.embed_tokens.weight; fix the config (tie_word_embeddings=False) or the weights"
            )
    return hf_sd


def rename_keys(sd: dict[str, Tensor], pairs: KeyPairs, *, to_hf: bool, what: str) -> dict[str, Tensor]:
    """Rename every key of `sd` through `pairs`; any missing or unexpected key is an error (nothing dropped)."""
    mapping = {ours: hf for hf, ours in pairs} if to_hf else dict(pairs)
    check_keys(sd.keys(), mapping.keys(), what)
    return {mapping[k]: sd[k] for k in mapping}


def check_keys(found, expected, what: str) -> None:
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{what}: state dict does not match the model config: "
            f"{len(missing)} missing (e.g. {missing[:5]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:5]})"
        )
