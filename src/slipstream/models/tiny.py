"""Tiny random models (every family of FAMILIES: llama, qwen3, the MoE families, nemotron_h's hybrid) with a locally
trained byte-level BPE tokenizer, for tests.

Built in a few seconds, deterministic for a seed, saved as float32 safetensors that transformers and vLLM (CPU) load.
"""

import json
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from slipstream.models.cache import check_replaceable, finalize_model_dir
from slipstream.utils.fs import commit_dir

FAMILIES = (
    "llama", "qwen3", "qwen3_moe", "glm4_moe", "minimax_m2", "glm_moe_dsa", "qwen3_5_moe_text", "afmoe", "gpt_oss",
    "nemotron_h", "laguna",
)  # fmt: skip
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
MAX_POSITIONS = 2048
# ChatML, as Qwen uses; no default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_NOUNS = "cat dog bird river mountain city teacher student robot garden ocean apple book house tree friend".split()
_ADJS = "small quick lazy bright quiet green happy old young heavy warm cold red blue strange gentle".split()
_VERBS = "sees likes finds follows builds paints reads helps watches carries answers visits".split()
_QUESTIONS = ["What is", "How many", "Why does", "Where is", "Can you tell me", "Please explain"]
_PROSE = (
    "Once upon a time there was a little village by the sea. Every morning the people would walk down to the "
    "harbour, where boats came back from the night with fish, stories and news from distant places. Children "
    "played between the nets while their parents worked, and an old woman sold bread, cheese and hot soup. "
    "When the weather changed, everyone gathered in the hall to listen to music, share dinner and discuss "
    "important questions: should we build a new bridge, plant more trees, or open a school for mathematics? "
    "Thinking carefully, step by step, usually gives the correct answer. First, read the problem. Second, write "
    "down what you know. Third, compute the result and check it again. Finally, report the number clearly. "
    "Python functions return values; a list contains items; the computer prints output and reads input. "
    "Science, history, language, geography and physics are subjects that students learn during the year."
)
_WORDS = sorted({w.strip(".,:;?!").lower() for w in _PROSE.split()} | set(_NOUNS + _ADJS + _VERBS))


def _corpus() -> list[str]:
    """A fixed, generated English corpus (sentences, questions, arithmetic, chat turns) to train the tokenizer."""
    rng = random.Random(1234)
    lines = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        n1, n2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
        lines += [
            f"The {rng.choice(_ADJS)} {n1} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} {n2}.",
            f"{rng.choice(_QUESTIONS)} the {n1} near the {n2}? It is {rng.choice(_ADJS)}, isn't it?",
            f"{a} + {b} = {a + b}. {a} * {b % 13} = {a * (b % 13)}. The answer is {a - b}.",
            f"{IM_START}user\nWhat is {a} plus {b}?{IM_END}\n{IM_START}assistant\nThe answer is {a + b}.{IM_END}",
            " ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + ".",
        ]
    return lines + _PROSE.split(". ")


def build_tokenizer(vocab_size: int = 512):
    """Train a byte-level BPE (digits split one by one) and wrap it as a `PreTrainedTokenizerFast` with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


def build_config(family: str, vocab_size: int, eos_token_id: int, pad_token_id: int):
    """2 layers, hidden 128, 4 query / 2 KV heads of head_dim 64 (vLLM CPU attention supports 64); MoE: 8 experts, top 2.

    llama ties its embeddings (like SmolLM2); qwen3 and qwen3_moe do not, so tests cover both layouts. glm4_moe has
    3 layers (a dense one, then 2 MoE layers, as the other MoE's 2) and GLM-4.5's features on: partial RoPE (0.5),
    q/k/v biases, q/k norm, a shared expert, group-limited routing (4 groups of 2, top 2 groups), scaling 2.5.
    minimax_m2 has MiniMax-M2's features: partial RoPE (rotary_dim 32 of 64), full-width q/k norm, sigmoid routing
    with a selection bias (random, as glm4_moe's), experts of width 64.
    glm_moe_dsa has GLM-5's: MLA (q rank 64, kv rank 32, 4 heads of 32 nope + 32 rope key dims and 64 value dims),
    a DSA indexer (32 heads, GLM-5's count, of 32 dims, interleaved RoPE as GLM-5's config says) keeping each query's
    top 4 keys (sparse from the 5th token on, even in the short samples of the distributed tests), glm4_moe's MoE.
    qwen3_5_moe_text is Qwen3.5-MoE's text model (Hub checkpoints, type `qwen3_5_moe`, wrap it with a vision encoder)
    with Qwen3.5's hybrid layout: a Gated DeltaNet layer (2 key heads, 4 value heads of 32 dims, conv of 4 taps) then a
    gated full-attention layer (partial RoPE: 16 of 64 dims), each with an MoE of 8 experts (top 2) + a gated shared
    expert.
    afmoe has Trinity's features: 3 layers (a dense one, then 2 MoE layers), two sliding-window layers (8 tokens, with
    RoPE) then a full-attention one (no RoPE), gated attention, sandwich norms, a shared expert, route_scale 2.5.
    gpt_oss has GPT-OSS's: a sliding-window layer (8 tokens) then a full one, attention sinks, q/k/v/o biases, YaRN
    RoPE, biased experts of width 64 with the clamped SwiGLU, a biased router.
    """
    from transformers import (
        AfmoeConfig,
        Glm4MoeConfig,
        GlmMoeDsaConfig,
        GptOssConfig,
        LlamaConfig,
        MiniMaxM2Config,
        Qwen3_5MoeTextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=False)
    if family == "qwen3_moe":
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
        return Qwen3MoeConfig(**common, **moe, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)
    if family == "glm4_moe":
        common["num_hidden_layers"] = 3
        moe = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1)
        routing = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
        return Glm4MoeConfig(
            **common, **moe, **routing, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
            partial_rotary_factor=0.5, tie_word_embeddings=False, num_nextn_predict_layers=0,
        )  # fmt: skip
    if family == "minimax_m2":
        common["intermediate_size"] = 64  # MiniMax-M2's intermediate_size is the routed experts' width
        moe = dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0)
        return MiniMaxM2Config(**common, **moe, rotary_dim=32, tie_word_embeddings=False)
    if family == "glm_moe_dsa":
        common.update(num_hidden_layers=3, num_key_value_heads=4)
        moe = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1)
        routing = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
        mla = dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64)
        dsa = dict(index_topk=4, index_n_heads=32, index_head_dim=32, indexer_rope_interleave=True)
        return GlmMoeDsaConfig(
            **common, **moe, **routing, **mla, **dsa, first_k_dense_replace=1, tie_word_embeddings=False
        )  # fmt: skip
    if family == "qwen3_5_moe_text":
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
        linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                      linear_value_head_dim=32, linear_conv_kernel_dim=4)  # fmt: skip
        del common["intermediate_size"]
        return Qwen3_5MoeTextConfig(
            **common, **moe, **linear, layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False
        )
    if family == "afmoe":
        common["num_hidden_layers"] = 3
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, num_shared_experts=1)
        return AfmoeConfig(
            **common, **moe, num_dense_layers=1, route_scale=2.5, sliding_window=8, tie_word_embeddings=False,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )  # fmt: skip
    if family == "gpt_oss":
        common["intermediate_size"] = 64  # GPT-OSS's intermediate_size is the experts' width
        moe = dict(num_local_experts=8, num_experts_per_tok=2)
        return GptOssConfig(**common, **moe, sliding_window=8, tie_word_embeddings=False)
    if family == "nemotron_h":
        return _nemotron_h_config(common)
    if family == "laguna":
        return _laguna_config(common)
    raise ValueError(f"unknown tiny model family '{family}' (known: {', '.join(FAMILIES)})")


def _nemotron_h_config(common: dict):
    """Nemotron-H's hybrid pattern in 5 layers: Mamba2 (8 heads of 16 dims, 2 groups, state 16, conv of 4 taps, SSD
    chunks of 16 tokens), an MoE (8 squared-ReLU experts top 2, sigmoid routing, a shared expert), NoPE attention, a
    squared-ReLU MLP, a second MoE (2 MoE layers, as the other MoE tiny models: the distributed tests' replay)."""
    from transformers import NemotronHConfig

    fields = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
    return NemotronHConfig(
        **fields, layer_norm_epsilon=1e-6, layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe"],
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
        tie_word_embeddings=False,
    )  # fmt: skip


def _laguna_config(common: dict):
    """Laguna's features in 3 layers: sliding (8 tokens, RoPE theta 10k) / full (partial RoPE: 32 of 64 dims, theta
    500k) / sliding attention with 4 / 8 / 4 query heads, softplus output gates per head, q/k norms; a dense first
    layer, then MoEs of 8 experts (top 2, sigmoid routing with a selection bias, logits softcapped at 5, scaling 2.5)
    plus a shared expert."""
    from transformers import LagunaConfig

    return LagunaConfig(
        **{**common, "num_hidden_layers": 3}, num_attention_heads_per_layer=[4, 8, 4], sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5,
        moe_router_logit_softcapping=5.0, tie_word_embeddings=False,
    )  # fmt: skip


def _add_hub_style_num_experts(config_path: Path) -> None:
    """transformers 5 saves `num_local_experts`; Qwen3-MoE checkpoints (and transformers 4.x) use `num_experts`."""
    config = json.loads(config_path.read_text())
    config["num_experts"] = config["num_local_experts"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_tiny_model(family: str, out_dir: Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """Build a random tiny `family` model + tokenizer into `out_dir` (replaced atomically if it is a model folder)."""
    import torch
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family '{family}' (known: {', '.join(FAMILIES)})")
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 byte tokens + specials + merges), got {vocab_size}")
    out_dir = Path(out_dir).expanduser().resolve()
    check_replaceable(out_dir)
    tokenizer = build_tokenizer(vocab_size)
    if len(tokenizer) > vocab_size:
        raise RuntimeError(f"trained tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    config = build_config(family, vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers inits the selection-only router bias at 0: make it matter in tests
    if family in ("glm4_moe", "minimax_m2", "glm_moe_dsa", "nemotron_h"):
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.05)
    if family == "laguna":  # its selection bias is a parameter, 0 at init: make it matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    param.normal_(0.0, 0.05)
    if family == "afmoe":  # transformers inits its router and selection bias at 0 (every score 0.5): make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("router.gate.weight", "mlp.expert_bias")):
                    param.normal_(0.0, 0.1)
    extra = (lambda folder: _add_hub_style_num_experts(folder / "config.json")) if family == "qwen3_moe" else None
    save_model_folder(model, tokenizer, out_dir, extra)
    return out_dir


def save_model_folder(model, tokenizer, out_dir: Path, write_extra: Callable[[Path], None] | None = None) -> None:
    """Save a built model + tokenizer (and whatever `write_extra` adds to the folder) into `out_dir`, atomically:
    written in a temp folder beside it, made portable (models/cache.py finalize_model_dir), then renamed into place."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        if write_extra is not None:
            write_extra(tmp_dir)
        finalize_model_dir(tmp_dir, MAX_POSITIONS)
        commit_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
