"""Throughput of the trainer's RL step (loss + backward + optimizer step) on fake packed data with random weights.

    python benchmarks/trainer_throughput.py --model qwen3-0.6b --seq-len 16384 --impl custom --compare-hf
    python benchmarks/trainer_throughput.py --model tiny --device cpu --seq-len 512 --compare-hf
    python benchmarks/trainer_throughput.py --model qwen3-30b-a3b-4l --compare-hf \
        --compare-anchor /work/shared/anchors/hf_moe/hf_moe_baseline.py
    python benchmarks/trainer_throughput.py --model qwen3-30b-a3b-8l --state-dtype bfloat16
    python benchmarks/trainer_throughput.py --model qwen3.5-moe-cut --seq-len 8192 --compare-hf
    python benchmarks/trainer_throughput.py --model tiny-qwen3.5-moe --device cpu --seq-len 256 --compare-hf
    python benchmarks/trainer_throughput.py --lm-head-memory --head-tokens 65536

Runs the trainer's own code (Policy, train_step, fused AdamW on float32 masters, bf16 autocast on GPUs) on one
device. Prints tokens/s, MFU and peak memory per implementation, and last `tokens_per_s: <x> mfu: <y>` for
`--impl` (plus `vs_hf: <ratio>` with --compare-hf). MFU uses REFERENCE.md's FLOPs/token: 6 x active matmul
parameters + 12 x layers x heads x head_dim x context, where context is the attended length per token (the mean
sample length weighted by tokens, as packed samples never attend to each other), over the dense bf16 peak of an
H100/H200 SXM (989e12 FLOP/s); n/a on CPU. For the MoE shapes (Qwen3-30B-A3B cut to 4 or 8 layers, every layer
MoE: 128 experts, top-8) the active MLP parameters are the top-8 experts' plus the router. GLM-5 (`glm5-cut`) and
Qwen3.5-MoE (`qwen3.5-moe-cut`, `tiny-qwen3.5-moe`) count their own layers: `dsa_matmul_params`, and
`qwen35_moe_matmul_params` + `gated_delta_rule_flops` (Gated DeltaNet layers: their projections and a sequence cost
linear in context; gated full-attention layers: the quadratic term above, over the full-attention layers only).

MoE options: `--expert-loop` runs our experts one by one (the reference) instead of the default grouped GEMMs;
`--state-dtype bfloat16` keeps AdamW's moments in bf16 (trainer/optim.py): the 8-layer cut's float32 masters,
gradients and float32 moments alone take 83.6 GiB, more than one H100. `--compare-anchor PATH` also runs the
plain-transformers pure-bf16 anchor script (e.g. /work/shared/anchors/hf_moe/hf_moe_baseline.py: bf16 weights and
optimizer states, transformers' grouped_mm experts; MoE shapes on CUDA only) in its own process and prints
`vs_hf_pure_bf16: <ratio>`.

`--impl custom` runs with torch.compile per block on CUDA (`--no-compile` to disable); the `hf` baseline is always
plain transformers (sdpa attention, eager), with the same activation checkpointing, trainer LM head and optimizer,
and with --compare-hf it runs first, in its own process.
`--lm-head-memory` instead measures the peak memory of the trainer's fused LM head (forward + backward) against
the unfused one (full [tokens, V] logits) at `--head-tokens` x vocab 151,936 (`measure_lm_head_memory`).
"""

import argparse
import gc
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.config.trainer import LossConfig, ParallelConfig
from slipstream.models.common.attention import build_attention_layout
from slipstream.models.common.moe import find_grouped_experts
from slipstream.models.qwen3_5_moe.delta_rule import CHUNK_SIZE as DELTA_RULE_CHUNK
from slipstream.models.registry import build_model, export_hf_state_dict
from slipstream.parallel.dist import init_distributed, rank_device, read_rank_info
from slipstream.parallel.fsdp import parallelize_model
from slipstream.parallel.mesh import build_mesh, resolve_parallel_dims
from slipstream.trainer.logprobs import DEFAULT_CHUNK_SIZE, chunked_lm_head_logprobs
from slipstream.trainer.optim import AdamWBf16Moments
from slipstream.trainer.policy import Policy
from slipstream.trainer.step import train_step
from slipstream.transport.rollouts import MicroBatch, TrainingBatch

PEAK_FLOPS = 989e12
"""Dense bf16 peak of an H100/H200 SXM."""
PROMPT_FRACTION = 0.2
"""Share of each fake sample that is prompt (no loss)."""
MOE_MODELS = {"qwen3-30b-a3b-4l": 4, "qwen3-30b-a3b-8l": 8}
"""Qwen3-30B-A3B's shape cut to this many layers (the anchor's, /work/shared/anchors/hf_moe)."""
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


def varied_lengths(seq_len: int, num_samples: int, seed: int) -> list[int]:
    """Sample lengths of one RL-like micro-batch: `num_samples` samples of random lengths (each at least 1/4 of an
    even share) filling between 3/4 of `seq_len` and all of it, different for every seed."""
    g = torch.Generator().manual_seed(10_000 + seed)
    total = int(seq_len * (0.75 + 0.25 * torch.rand((), generator=g).item()))
    weights = 0.25 + torch.rand(num_samples, generator=g)
    lengths = [max(1, int(total * w / weights.sum())) for w in weights.tolist()]
    lengths[-1] += total - sum(lengths)
    return lengths


def fake_batch(
    seq_len: int, num_samples: int, vocab_size: int, seed: int = 0, lengths: list[int] | None = None
) -> tuple[TrainingBatch, float]:
    """One micro-batch of `seq_len` tokens packing `num_samples` samples of equal length (or of `lengths`, whose sum
    is then the micro-batch's length); returns it and the attended context."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = [seq_len // num_samples] * num_samples
        lengths[-1] += seq_len - sum(lengths)
    seq_len = sum(lengths)
    ids, pos, mask = torch.randint(0, vocab_size, (seq_len,), generator=g).tolist(), [], []
    for n in lengths:
        num_prompt = max(1, int(PROMPT_FRACTION * n))
        pos += list(range(n))
        mask += [False] * num_prompt + [True] * (n - num_prompt)
    sign = (torch.randint(0, 2, (seq_len,), generator=g) * 2 - 1).tolist()
    lq = (-torch.rand(seq_len, generator=g) * 3).tolist()
    mb = MicroBatch(
        input_ids=ids,
        position_ids=pos,
        loss_mask=mask,
        advantages=[float(s) if m else 0.0 for s, m in zip(sign, mask, strict=True)],
        inference_logprobs=[x if m else 0.0 for x, m in zip(lq, mask, strict=True)],
        temperatures=[1.0] * seq_len,
    )
    context = sum(n * n for n in lengths) / seq_len
    return TrainingBatch(step=1, rank=0, num_loss_tokens=sum(mask), micro_batches=[mb]), context


def build_random_model(cfg, impl: str, device: torch.device, hf_experts: str = "grouped_mm") -> torch.nn.Module:
    """A float32 model of `impl` on `device` with the same random weights for both impls (ours, seed 0); a
    transformers MoE runs its experts with `hf_experts` (transformers' `experts_implementation`)."""
    torch.manual_seed(0)
    with torch.device(device):
        ours = build_model(cfg, "custom").float()
    if impl == "custom":
        return ours
    with torch.device(device):
        model = build_hf_model(cfg, hf_experts).float()
    missing, unexpected = model.load_state_dict(fuse_experts(export_hf_state_dict(ours), model), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()):
        raise RuntimeError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return model


def build_hf_model(cfg, hf_experts: str = "grouped_mm") -> torch.nn.Module:
    """transformers' model for `cfg` as the baseline runs it (SDPA attention, MoE experts by `hf_experts`), on the
    current default device (`with torch.device("meta"):` checks a config without allocating it)."""
    cfg._attn_implementation = "sdpa"  # the transformers baseline: SDPA attention
    if getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None):
        cfg._experts_implementation = hf_experts  # transformers' own choice of MoE kernel
    return build_model(cfg, "hf")


def fuse_experts(hf_sd: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert MoE weights (`mlp.experts.{e}.{gate,up,down}_proj.weight`) stacked into the
    fused layout transformers 5 holds in memory (`gate_up_proj` [E, 2F, D] gate rows first, `down_proj` [E, D, F])
    where `model` has it; other keys unchanged."""
    fused_prefixes = [k.removesuffix("gate_up_proj") for k in model.state_dict() if k.endswith("experts.gate_up_proj")]
    for prefix in fused_prefixes:
        stacked = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys = sorted((k for k in hf_sd if k.startswith(prefix) and k.endswith(f".{proj}.weight")),
                          key=lambda k: int(k.removeprefix(prefix).split(".")[0]))  # fmt: skip
            stacked[proj] = torch.stack([hf_sd.pop(k) for k in keys])
        hf_sd[prefix + "gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        hf_sd[prefix + "down_proj"] = stacked["down_proj"]
    return hf_sd


@dataclass
class Result:
    impl: str
    tokens_per_s: float
    mfu: float | None
    peak_memory_gib: float
    step_s: float


def run_impl(args: argparse.Namespace, impl: str, device: torch.device) -> Result:
    """Build a fresh random model of `impl`, run warmup + measured steps, return the figures."""
    cfg = build_hf_config(args.model)
    model = build_random_model(cfg, impl, device, args.hf_experts)
    compile = args.compile and impl == "custom"
    if args.expert_loop and impl == "custom" and hasattr(model, "set_grouped_mm"):
        model.set_grouped_mm(False)
    if impl == "custom":
        model.packed_attention = args.packed_attention
    parallel = ParallelConfig(
        ep=args.ep, activation_checkpointing=args.ac, activation_checkpointing_keep_attention=args.keep_attention
    )
    mesh = None
    if args.world_size > 1:  # torchrun: FSDP over every rank, the experts sharded over `--ep` of them
        mesh = build_mesh(resolve_parallel_dims(parallel, args.world_size), device.type)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    experts = find_grouped_experts(model) if impl == "custom" else []
    policy = parallelize_model(Policy(model), mesh, parallel, compute_dtype, compile=compile, experts=experts)
    if args.state_dtype == "bfloat16":
        optimizer = AdamWBf16Moments(policy.parameters(), lr=1e-6)
    else:
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True if device.type == "cuda" else None)
    if args.vary_lengths:  # a new packing every step, warm-up included: lengths never seen before are measured
        batches = [
            fake_batch(0, 0, cfg.vocab_size, args.rank, varied_lengths(args.seq_len, args.num_samples, s))
            for s in range(args.warmup + args.steps)
        ]
    else:
        batches = [fake_batch(args.seq_len, args.num_samples, cfg.vocab_size, seed=args.rank)]
    # Under FSDP the parameters arrive in bf16 already (its mixed-precision policy), as in the trainer's setup.
    autocast_dtype = torch.float32 if mesh is not None and device.type == "cuda" else compute_dtype
    step_s, metrics = time_steps(
        policy, optimizer, [b for b, _ in batches], device, autocast_dtype, args.warmup, args.steps
    )
    if args.profile is not None and impl == args.impl:
        # every rank runs the step (its collectives), rank 0 writes the profile
        profile_step(policy, optimizer, batches[-1][0], device, compute_dtype, args.profile if args.rank == 0 else None)
    measured = batches[-args.steps :] if args.vary_lengths else batches
    tokens = sum(len(b.micro_batches[0].input_ids) for b, _ in measured) / len(measured)
    context = sum(c * len(b.micro_batches[0].input_ids) for b, c in measured) / (tokens * len(measured))
    tokens_per_s = tokens / step_s
    mfu = flops_per_token(cfg, context) * tokens_per_s / PEAK_FLOPS if device.type == "cuda" else None
    peak = _peak_memory_gib(device)
    per_gpu = f" per GPU ({args.world_size} ranks, ep {args.ep})" if args.world_size > 1 else ""
    _print0(
        args,
        f"{impl:>6}: {tokens_per_s:,.0f} tokens/s{per_gpu} | MFU {_fmt_mfu(mfu)} | peak memory {peak:.2f} GiB | "
        f"{step_s:.3f} s/step | loss {metrics['loss']:.4f}",
    )
    del policy, model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Result(impl, tokens_per_s, mfu, peak, step_s)


def _print0(args: argparse.Namespace, line: str) -> None:
    if args.rank == 0:
        print(line, flush=True)


def time_steps(policy, optimizer, batches, device, compute_dtype, num_warmup: int, num_steps: int):
    """(seconds per measured step, metrics of the last step); peak GPU memory is reset after the warmup. `batches`:
    one TrainingBatch for every step, or a list that step i takes entry i of (cycling)."""
    batches = batches if isinstance(batches, list) else [batches]
    for i in range(num_warmup):
        train_step(policy, optimizer, batches[i % len(batches)], LossConfig(), 1.0, device, compute_dtype)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for i in range(num_warmup, num_warmup + num_steps):
        metrics = train_step(policy, optimizer, batches[i % len(batches)], LossConfig(), 1.0, device, compute_dtype)
    _sync(device)
    return (time.perf_counter() - start) / num_steps, metrics


def profile_step(policy, optimizer, batch, device, compute_dtype, path: Path | None) -> None:
    """Two more steps under torch.profiler (the second shows the GPU's idle time between steps); writes their
    operators sorted by self device time (the kernels that take the steps) to `path`, and the same trace as Chrome
    JSON next to it (`path` + .json)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(2):
            train_step(policy, optimizer, batch, LossConfig(), 1.0, device, compute_dtype)
        _sync(device)
    if path is None:
        return
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=45, max_name_column_width=90)
    path.write_text(table)
    prof.export_chrome_trace(str(path) + ".json")
    print(f"profile of two steps: {path}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory of the measured steps; on CPU the process's peak resident set size so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _fmt_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


HEAD_VOCAB, HEAD_DIM = 151936, 1024
"""Qwen3-0.6B's LM head shape for --lm-head-memory."""


def unfused_lm_head_logprobs(weight_VD, hidden_ND, token_ids_N, temperatures_N):
    """The head without chunking or fusion, same maths: full [N, V] logits and a float32 log-softmax."""
    logits_NV = F.linear(hidden_ND, weight_VD)
    logp_NV = F.log_softmax(logits_NV.float() / temperatures_N.unsqueeze(-1), dim=-1)
    logprobs_N = logp_NV.gather(-1, token_ids_N.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logprobs_N, entropy_N


def fused_lm_head_logprobs(weight_VD, hidden_ND, token_ids_N, temperatures_N):
    """The trainer's head (trainer/logprobs.py + trainer/lm_head.py) at its default chunk size."""
    return chunked_lm_head_logprobs(weight_VD, hidden_ND, token_ids_N, temperatures_N, DEFAULT_CHUNK_SIZE)


def head_peak_gib(head, num_tokens: int, device: torch.device) -> float | None:
    """Peak GPU memory of head's forward + backward above its inputs (float32 W [V, D] and hidden [N, D], as the
    trainer holds them), in GiB; gradients of W and hidden included. None when it runs out of memory."""
    g = torch.Generator(device).manual_seed(0)
    weight_VD = (torch.randn(HEAD_VOCAB, HEAD_DIM, device=device, generator=g) * 0.02).requires_grad_()
    hidden_ND = torch.randn(num_tokens, HEAD_DIM, device=device, generator=g).requires_grad_()
    token_ids_N = torch.randint(0, HEAD_VOCAB, (num_tokens,), device=device, generator=g)
    temperatures_N = torch.rand(num_tokens, device=device, generator=g) + 0.5
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logprobs_N, _ = head(weight_VD, hidden_ND, token_ids_N, temperatures_N)
        logprobs_N.sum().backward()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**30
    except torch.OutOfMemoryError:
        return None
    finally:
        del weight_VD, hidden_ND
        gc.collect()
        torch.cuda.empty_cache()


def measure_lm_head_memory(device: torch.device, num_tokens: int) -> dict[str, float | str | None]:
    """Fused vs unfused peak at num_tokens. When the unfused head does not fit, its peak is extrapolated linearly
    from num_tokens / 8 and / 4 (the unfused peak is affine in tokens: every [N, V] tensor scales with N)."""
    head_peak_gib(fused_lm_head_logprobs, num_tokens, device)  # compiles the fused kernels first
    fused = head_peak_gib(fused_lm_head_logprobs, num_tokens, device)
    unfused = head_peak_gib(unfused_lm_head_logprobs, num_tokens, device)
    figures: dict[str, float | str | None] = {"fused_gib": round(fused, 2)}
    if unfused is not None:
        figures |= {"unfused_gib": round(unfused, 2), "unfused_source": "measured"}
    else:
        small, large = num_tokens // 8, num_tokens // 4
        peak_small, peak_large = (head_peak_gib(unfused_lm_head_logprobs, n, device) for n in (small, large))
        unfused = peak_large + (peak_large - peak_small) / (large - small) * (num_tokens - large)
        figures |= {
            "unfused_gib": round(unfused, 2),
            "unfused_source": f"out of memory; extrapolated from {small}: {peak_small:.2f} and {large}: {peak_large:.2f}",
        }
    figures["fused_over_unfused"] = round(fused / unfused, 4)
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=MODELS)
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per micro-batch (one per step)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples packed into the micro-batch")
    parser.add_argument("--impl", default="custom", choices=["custom", "hf"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True, help="activation checkpointing")
    parser.add_argument(
        "--keep-attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --ac, keep attention outputs instead of recomputing them (trainer.parallel."
        "activation_checkpointing_keep_attention); --no-keep-attention = full recomputation",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="under torchrun (several ranks, one GPU each): expert parallelism over this many ranks, FSDP over all; "
        "figures are per GPU, each rank training its own micro-batch",
    )
    parser.add_argument(
        "--packed-attention",
        default="varlen",
        choices=["varlen", "flex"],
        help="kernel for packed rows of --impl custom (trainer.packed_attention; flex: GPUs only)",
    )
    parser.add_argument("--compare-hf", action="store_true", help="also run --impl hf and print the ratio")
    parser.add_argument(
        "--compare-anchor",
        type=Path,
        default=None,
        metavar="PATH",
        help="also run the pure-bf16 transformers MoE anchor script at PATH (CUDA, MoE shapes) and print the ratio",
    )
    parser.add_argument("--expert-loop", action="store_true", help="MoE: loop over experts instead of grouped GEMMs")
    parser.add_argument(
        "--hf-experts",
        default="grouped_mm",
        choices=["eager", "grouped_mm", "batched_mm"],
        help="MoE: transformers' experts implementation for --impl hf",
    )
    parser.add_argument(
        "--state-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of AdamW's moments (trainer.optim.state_dtype); float32 masters either way",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each block of --impl custom (default: on CUDA only); never the hf baseline",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="PATH",
        help="after timing, profile two more steps of --impl and write their top operators to PATH (+ PATH.json trace)",
    )
    parser.add_argument(
        "--compare-torchtitan",
        type=Path,
        default=None,
        metavar="PATH",
        help="also run torchtitan's trainer through the anchor driver at PATH (tt_bench.py: the same dense shape, "
        "seq and documents per row) and print the ratio",
    )
    parser.add_argument(
        "--rows",
        default="auto",
        choices=["auto", "packed"],
        help="custom dense models, several samples: 'auto' lets the trainer choose between the packed row and one "
        "padded row per sample (trainer/row_layout.py: padded where no fused varlen kernel runs, e.g. on CPU); "
        "'packed' keeps the packed row",
    )
    parser.add_argument(
        "--vary-lengths",
        action="store_true",
        help="a new packing every step, as RL micro-batches have: --num-samples samples of random lengths filling "
        "3/4 to all of --seq-len (warm-up steps included, so measured steps see lengths never seen before); "
        "tokens/s counts the measured steps' tokens. The baselines (--compare-*) run their fixed shapes: no ratio",
    )
    parser.add_argument("--lm-head-memory", action="store_true", help="measure the LM head's memory instead")
    parser.add_argument("--head-tokens", type=int, default=65536, help="tokens for --lm-head-memory")
    args = parser.parse_args(argv)
    if args.compile is None:
        args.compile = args.device == "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU; use --device cpu (with --model tiny)")
    if args.steps < 1 or args.num_samples < 1 or args.seq_len < 2 * args.num_samples:
        parser.error("need --steps >= 1, --num-samples >= 1 and --seq-len >= 2 x --num-samples")
    if args.vary_lengths and (args.compare_hf or args.compare_anchor or args.compare_torchtitan):
        parser.error("--vary-lengths measures Slipstream alone: the baselines run fixed shapes, drop --compare-*")
    if args.compare_anchor is not None and (args.model not in MOE_MODELS or args.device != "cuda"):
        parser.error(
            f"--compare-anchor runs the MoE anchor on CUDA: use --device cuda and --model {' or '.join(MOE_MODELS)}"
        )
    if args.compare_torchtitan is not None and (args.model != "qwen3-0.6b" or args.device != "cuda"):
        parser.error("--compare-torchtitan runs torchtitan's Qwen3 0.6B flavor on CUDA: use --model qwen3-0.6b")
    if args.compare_torchtitan is not None and not args.compare_torchtitan.is_file():
        parser.error(f"--compare-torchtitan {args.compare_torchtitan}: no such file")
    if args.compare_anchor is not None and not args.compare_anchor.is_file():
        parser.error(f"--compare-anchor {args.compare_anchor}: no such file")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = read_rank_info()
    args.rank, args.world_size = info.rank, info.world_size
    device = rank_device(args.device, info)
    if info.world_size > 1 and (args.compare_hf or args.compare_anchor or args.compare_torchtitan):
        raise SystemExit("under torchrun only our trainer runs: drop --compare-* (run them on one GPU)")
    if info.world_size == 1 and args.ep > 1:
        raise SystemExit(f"--ep {args.ep} needs torchrun with a multiple of {args.ep} ranks")
    owns_group = init_distributed(info, device)
    try:
        _main(args, device)
    finally:
        if owns_group:
            torch.distributed.destroy_process_group()


def _main(args: argparse.Namespace, device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if args.lm_head_memory:
        figures = measure_lm_head_memory(device, args.head_tokens)
        print(f"LM head, {args.head_tokens} tokens x vocab {HEAD_VOCAB} | {name} | bf16 autocast | forward + backward")
        print(f"peak above inputs: {figures}", flush=True)
        return
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    position_ids = torch.tensor(fake_batch(args.seq_len, args.num_samples, 2)[0].micro_batches[0].position_ids)
    attention = build_attention_layout(position_ids[None].to(device), compute_dtype).backend
    if args.packed_attention == "flex" and args.num_samples > 1:
        attention = "flex"  # the layout names the default kernel; the model's packed_attention overrides it
    is_moe = args.model == "tiny-moe" or args.model in (*MOE_MODELS, *DSA_MODELS, *QWEN35_MOE_MODELS)
    ac_mode = (" (keeps attention)" if args.keep_attention else " (full)") if args.ac else ""
    experts = f", experts {'loop' if args.expert_loop else 'grouped_mm'}" if is_moe else ""
    _print0(
        args,
        f"{args.model} | seq {args.seq_len} in {args.num_samples} sample(s) | {name} | torch {torch.__version__} | "
        f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'} | activation checkpointing {args.ac}{ac_mode} | "
        f"custom: attention {attention}, compile {args.compile}{experts} | AdamW moments {args.state_dtype}",
    )
    anchor = run_anchor_in_subprocess(args) if args.compare_anchor is not None else None
    titan = run_torchtitan_in_subprocess(args) if args.compare_torchtitan is not None else None
    baseline = run_baseline_in_subprocess(args) if args.compare_hf and args.impl != "hf" else None
    row_choices = record_row_choices(args.rows)
    result = run_impl(args, args.impl, device)
    if row_choices:
        _print0(args, f"rows: {'padded, one per sample' if all(row_choices) else 'packed'} ({len(row_choices)} calls)")
    line = f"tokens_per_s: {result.tokens_per_s:.1f} mfu: {_fmt_mfu(result.mfu)}"
    if baseline is not None:
        tokens_per_s, report = baseline
        print(report, flush=True)
        line += f" vs_hf: {result.tokens_per_s / tokens_per_s:.3f}"
    if anchor is not None:
        tokens_per_s, report = anchor
        print(f"anchor: {report}", flush=True)
        line += f" vs_hf_pure_bf16: {result.tokens_per_s / tokens_per_s:.3f}"
    if titan is not None:
        tokens_per_s, report = titan
        print(f"torchtitan: {report}", flush=True)
        line += f" vs_torchtitan: {result.tokens_per_s / tokens_per_s:.3f}"
    _print0(args, line)


def record_row_choices(rows: str) -> list[bool]:
    """The trainer's row-layout decisions (True: padded rows) of this run, in a list filled as it runs; with
    `rows = "packed"` every decision is the packed row."""
    from slipstream.trainer import logprobs

    choices: list[bool] = []
    choose = getattr(logprobs.use_padded_rows, "__wrapped__", logprobs.use_padded_rows)  # not a wrapper's wrapper

    def recorded(*args) -> bool:
        choices.append(rows == "auto" and choose(*args))
        return choices[-1]

    recorded.__wrapped__ = choose
    logprobs.use_padded_rows = recorded
    return choices


def run_anchor_in_subprocess(args: argparse.Namespace) -> tuple[float, str]:
    """(tokens/s, its report line) of the pure-bf16 transformers anchor (`SEQ LAYERS grouped_mm`: its own random
    single-sample batch, full activation checkpointing, fused bf16 AdamW), run first in a fresh process."""
    cmd = [sys.executable, str(args.compare_anchor), str(args.seq_len), str(MOE_MODELS[args.model]), "grouped_mm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if "tokens_per_s=" in line]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the anchor failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    tokens_per_s = float(lines[-1].split("tokens_per_s=")[1].split()[0])
    return tokens_per_s, lines[-1]


TITAN_STEPS, TITAN_MEASURED = 16, 10
"""torchtitan steps run, and how many of the last ones are averaged (its first steps compile and warm up)."""


def run_torchtitan_in_subprocess(args: argparse.Namespace) -> tuple[float, str]:
    """(mean tokens/s of torchtitan's last TITAN_MEASURED steps, a report line): torchtitan's own Trainer on its
    Qwen3 0.6B flavor through the anchor driver, one GPU, with `--seq-len` tokens per row in `--num-samples`
    documents, full activation checkpointing and compile (the driver's settings), in a fresh process first."""
    import os
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, TT_SEQ=str(args.seq_len), TT_DOCS=str(args.num_samples), TT_STEPS=str(TITAN_STEPS))
        env |= {"TT_LOSS": "plain", "TT_CUDAGRAPHS": "0", "TT_DUMP": dump}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        proc = subprocess.run([*cmd, str(args.compare_torchtitan)], capture_output=True, text=True, env=env)
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    rows = re.findall(r"step:\s*(\d+)\s+loss:.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%", text)
    if proc.returncode != 0 or len(rows) < TITAN_MEASURED:
        raise RuntimeError(f"torchtitan failed ({proc.returncode}, {len(rows)} steps logged):\n{text[-4000:]}")
    tail = rows[-TITAN_MEASURED:]
    tokens_per_s = sum(float(r[2].replace(",", "")) for r in tail) / len(tail)
    mfu = sum(float(r[3]) for r in tail) / len(tail)
    report = (
        f"{tokens_per_s:,.0f} tokens/s (mean of steps {tail[0][0]}-{tail[-1][0]}), its MFU {mfu:.1f}%, "
        f"reserved {tail[-1][1]} GiB"
    )
    return tokens_per_s, report


def run_baseline_in_subprocess(args: argparse.Namespace) -> tuple[float, str]:
    """(tokens/s, its report line) of `--impl hf` with the same settings, run first and in a fresh process: one run
    in a process slowed the next there (seen on an H100: hf at 18.1k tokens/s after our model, 23.2k alone)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--impl", "hf", "--model", args.model]
    cmd += ["--seq-len", str(args.seq_len), "--num-samples", str(args.num_samples), "--device", args.device]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--ac" if args.ac else "--no-ac"]
    cmd += ["--keep-attention" if args.keep_attention else "--no-keep-attention"]
    cmd += ["--state-dtype", args.state_dtype, "--hf-experts", args.hf_experts]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("tokens_per_s: "):
        raise RuntimeError(f"the hf baseline failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    report = next(line for line in lines if line.lstrip().startswith("hf:"))
    return float(lines[-1].split()[1]), report


if __name__ == "__main__":
    main()
