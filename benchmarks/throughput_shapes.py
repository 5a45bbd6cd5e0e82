"""Model shapes and FLOPs accounting of the trainer benchmarks (trainer_throughput.py, fp8_training.py): the configs
behind each `--model` name (Qwen3-0.6B, Qwen3-30B-A3B cut to 4 or 8 layers, GLM-5 and Qwen3.5-MoE cuts, the tiny CPU
shapes) and the FLOPs per token that MFU divides by (trainer_throughput.py's docstring states the formula).
"""

from slipstream.models.qwen3_5_moe.delta_rule import CHUNK_SIZE as DELTA_RULE_CHUNK

PEAK_FLOPS = 989e12
"""Dense bf16 peak of an H100/H200 SXM."""
MOE_MODELS = {"qwen3-30b-a3b-4l": 4, "qwen3-30b-a3b-8l": 8}
"""Qwen3-30B-A3B's shape cut to this many layers (the plain-transformers MoE anchor's cut)."""
DSA_MODELS = {"glm5-cut": 2}
"""GLM-5's shape (MLA + DSA attention, top-2048 keys; 256 experts, top-8, a shared expert) cut to fit one GPU: this
many layers (the first dense, the others MoE) and 32 routed experts per MoE layer."""
QWEN35_MOE_MODELS = {"qwen3.5-moe-cut": 4, "tiny-qwen3.5-moe": 4}
"""Qwen3.5-MoE (`qwen3_5_moe_text`, the text model of Qwen/Qwen3.5-35B-A3B) with this many layers: the real pattern's
first block, three Gated DeltaNet (linear attention) layers then a gated full-attention one; every layer an MoE.
`qwen3.5-moe-cut` keeps Qwen3.5-35B-A3B's dimensions but the layer count (40 -> 4) and the routed experts (256 -> 64,
QWEN35_CUT_EXPERTS) to fit one 80 GB GPU, `qwen35_moe_cut_config` says why; `tiny-qwen3.5-moe` is the same pattern
at models/tiny.py's tiny dimensions (vocab 512), for CPU checks."""
QWEN35_CUT_EXPERTS = 64
"""Routed experts per layer of `qwen3.5-moe-cut` (Qwen3.5-35B-A3B: 256); top-8 and the shared expert kept."""
MODELS = ["qwen3-0.6b", "tiny", "tiny-moe", *MOE_MODELS, *DSA_MODELS, *QWEN35_MOE_MODELS]


def build_hf_config(name: str):
    """A Qwen3 config: the shape of Qwen3-0.6B (vocab 151936), Qwen3-30B-A3B cut to 4 or 8 layers, or the 2-layer
    tiny test shapes (vocab 512; tiny-moe: 8 experts, top-2); GLM-5 cut (`glm5_cut_config`); a Qwen3.5-MoE text
    config (`qwen35_moe_cut_config`, `tiny_qwen35_moe_config`)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if name == "tiny-qwen3.5-moe":
        return tiny_qwen35_moe_config(QWEN35_MOE_MODELS[name])
    if name in QWEN35_MOE_MODELS:
        return qwen35_moe_cut_config(QWEN35_MOE_MODELS[name])
    if name in ("tiny", "tiny-moe"):
        from slipstream.models.tiny import build_config

        return build_config("qwen3" if name == "tiny" else "qwen3_moe", vocab_size=512, eos_token_id=2, pad_token_id=0)
    if name in MOE_MODELS:
        return Qwen3MoeConfig(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=MOE_MODELS[name],
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=False,
        )
    if name in DSA_MODELS:
        return glm5_cut_config(DSA_MODELS[name])
    if name == "qwen3-0.6b":
        return Qwen3Config(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=True,
        )
    raise ValueError(f"unknown --model {name!r}; choose one of {', '.join(MODELS)}")


def glm5_cut_config(num_layers: int):
    """GLM-5's config (zai-org/GLM-5's dimensions) with `num_layers` layers, the first dense, and 32 routed experts."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=num_layers, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
        n_routed_experts=32, num_experts_per_tok=8, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048,
        qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, index_topk=2048, index_head_dim=128,
        index_n_heads=32, first_k_dense_replace=1, max_position_embeddings=202752, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
    )  # fmt: skip


def qwen35_layer_types(num_layers: int, full_attention_interval: int = 4) -> list[str]:
    """Qwen3.5's layout: every `full_attention_interval`-th layer gated full attention, the others Gated DeltaNet."""
    return [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)
    ]


def qwen35_moe_cut_config(num_layers: int, num_experts: int = QWEN35_CUT_EXPERTS):
    """Qwen/Qwen3.5-35B-A3B's text config (transformers' `Qwen3_5MoeTextConfig`, whose defaults are that model's)
    with `num_layers` layers in its pattern (3 Gated DeltaNet : 1 gated full attention) and `num_experts` routed
    experts per layer.

    Kept: hidden 2048; gated full attention of 16 query heads, 2 KV heads, head_dim 256 (q_proj doubled for the
    output gate, partial RoPE over 64 of the 256 dims, theta 1e7); Gated DeltaNet of 16 query/key heads and 32 value
    heads of 128 dims, conv of 4 taps; experts of width 512, top-8 with renormalised weights, one gated shared expert
    of width 512; vocab 248320, untied LM head.
    Cut: layers 40 -> 4 (layers 0-3 of the real model: 3 linear + 1 full) and routed experts 256 -> 64. With 4
    layers of 256 experts the model holds 4.38 B parameters: its float32 masters, gradients and two AdamW moments (16
    bytes a parameter) would take 70.1 GB, all but 10 of an H100's 80 GB before any activation. 64 experts give
    1.96 B parameters (1.02 B of them the embedding and the untied LM head, vocab 248320 x 2048 each; 0.80 B the
    experts): 31.4 GB (29.3 GiB) of weights, gradients and moments, leaving ~45 GB for the activations of 16384
    tokens (activation checkpointing, the trainer's chunked LM head). Per token the cut runs 0.75 B matmul
    parameters (the LM head's 0.51 B included; `qwen35_moe_matmul_params`), as the real model's first 4 layers do
    but for the router's width: top-8 of 64 experts cost what top-8 of 256 do."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=num_layers, layer_types=qwen35_layer_types(num_layers),
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=num_experts, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        router_aux_loss_coef=0.001, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        tie_word_embeddings=False,
    )  # fmt: skip


def tiny_qwen35_moe_config(num_layers: int):
    """models/tiny.py's Qwen3.5-MoE text config (hidden 128, vocab 512, 8 experts top-2 + a gated shared expert,
    Gated DeltaNet of 2 key / 4 value heads of 32 dims, full attention of 4 / 2 heads of 64 dims) with
    `num_layers` layers in Qwen3.5's pattern (tiny.py's own has 2: linear then full)."""
    from slipstream.models.tiny import build_config

    cfg = build_config("qwen3_5_moe_text", vocab_size=512, eos_token_id=2, pad_token_id=0)
    cfg.num_hidden_layers, cfg.layer_types = num_layers, qwen35_layer_types(num_layers)
    return cfg


def gated_deltanet_matmul_params(cfg) -> int:
    """One Gated DeltaNet layer's projections (transformers' `linear_attn`): `in_proj_qkv` (q and k of the key heads,
    v of the value heads), `in_proj_z` (the output gate, value width), `in_proj_b` and `in_proj_a` (beta and the
    decay's input, one per value head), `out_proj`. The depthwise causal conv (conv kernel taps per channel and
    token, 4 x 8192 MACs in Qwen3.5-35B-A3B against its projections' 34 M) is no matmul and left out."""
    D = cfg.hidden_size
    key_width = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_width = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    in_proj = D * (2 * key_width + value_width) + D * value_width + 2 * D * cfg.linear_num_value_heads
    return in_proj + value_width * D


def gated_attention_matmul_params(cfg) -> int:
    """One gated full-attention layer's projections (`self_attn`): `q_proj` yields each head's query and its output
    gate (2 x heads x head_dim outputs), `k_proj` and `v_proj` the KV heads, `o_proj`."""
    D, H, G, K = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return D * 2 * H * K + 2 * D * G * K + H * K * D


def shared_expert_moe_matmul_params(cfg) -> int:
    """One Qwen3.5-MoE MLP per token: the top-k routed SwiGLU experts, the shared one, the router over all experts and
    the shared expert's scalar gate."""
    D = cfg.hidden_size
    experts = 3 * D * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
    return experts + D * cfg.num_experts + D


def qwen35_moe_matmul_params(cfg) -> int:
    """Qwen3.5-MoE: each layer's token mixer (Gated DeltaNet or gated attention, per `layer_types`), its MoE, and the
    LM head."""
    mixers = sum(
        gated_deltanet_matmul_params(cfg) if t == "linear_attention" else gated_attention_matmul_params(cfg)
        for t in cfg.layer_types
    )
    return mixers + cfg.num_hidden_layers * shared_expert_moe_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size


def gated_delta_rule_flops(cfg, chunk_size: int = DELTA_RULE_CHUNK) -> float:
    """Training FLOPs per token of one Gated DeltaNet layer's sequence mixing (forward + backward, 3 x forward, as 6 x
    parameters is for the matmuls), approximated as the chunked gated delta rule (models/qwen3_5_moe/delta_rule.py,
    FLA's algorithm) at chunk C: per value head and chunk of C tokens, with key dim K and value dim V, the C x C
    blocks k k^T and q k^T (C^2 K each), the two unitriangular solves for u (C^2 V / 2) and w (C^2 K / 2), the
    intra-chunk product with u (C^2 V), and the state's read by w and q and its update (C K V each): per token
    C (2.5 K + 1.5 V) + 3 K V multiply-adds, whatever the context (the cost is linear in the sequence). Blocks are
    counted dense (no causal halving, as kernels compute them), padding and masks, the L2 norms, decays and gates
    (elementwise) left out; the recomputation of the forward in the backward is not counted (as for checkpointing)."""
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    macs = chunk_size * (2.5 * K + 1.5 * V) + 3 * K * V
    return 3 * 2 * cfg.linear_num_value_heads * macs


def dsa_matmul_params(cfg) -> int:
    """GLM-5: MLA projections, the dense MLP or the top-k + shared experts and router per layer, and the LM head;
    the indexer's projections are left out (they run forward only, without gradient)."""
    H, D = cfg.num_attention_heads, cfg.hidden_size
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attention = D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    attention += cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H * cfg.v_head_dim * D
    experts = (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * D * cfg.moe_intermediate_size
    moe = experts + D * cfg.n_routed_experts  # + the router
    mlps = sum(moe if t == "sparse" else 3 * D * cfg.intermediate_size for t in cfg.mlp_layer_types)
    return cfg.num_hidden_layers * attention + mlps + cfg.vocab_size * D


def active_matmul_params(cfg) -> int:
    """Matmul weights one token goes through: attention and MLP projections of every layer (for a MoE, where every
    layer is one here: its top-k experts and the router), plus the LM head."""
    if cfg.model_type == "glm_moe_dsa":
        return dsa_matmul_params(cfg)
    if cfg.model_type == "qwen3_5_moe_text":
        return qwen35_moe_matmul_params(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    attention = cfg.hidden_size * (2 * q_out + 2 * kv_out)
    if getattr(cfg, "num_experts", None):
        experts = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        mlp = experts + cfg.hidden_size * cfg.num_experts
    else:
        mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_hidden_layers * (attention + mlp) + cfg.vocab_size * cfg.hidden_size


def flops_per_token(cfg, context: float) -> float:
    if cfg.model_type == "glm_moe_dsa":  # a query attends to its top-k keys at most; q.k over 256 dims, then 256 v
        qk_v = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2
        attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * qk_v * min(context, cfg.index_topk)
        return 6 * active_matmul_params(cfg) + attention
    if cfg.model_type == "qwen3_5_moe_text":  # quadratic full-attention layers, linear Gated DeltaNet ones
        num_full = cfg.layer_types.count("full_attention")
        attention = 12 * num_full * cfg.num_attention_heads * cfg.head_dim * context
        attention += (cfg.num_hidden_layers - num_full) * gated_delta_rule_flops(cfg)
        return 6 * active_matmul_params(cfg) + attention
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context
    return 6 * active_matmul_params(cfg) + attention
