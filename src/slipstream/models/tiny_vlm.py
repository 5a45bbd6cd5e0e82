"""Tiny random vision-language models of the Qwen3-VL kind, one per family of VLM_FAMILIES (Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5, Qwen3.5-MoE: in transformers 5 all four are `...ForConditionalGeneration` models with a vision tower), with
tiny.py's byte-level BPE tokenizer plus the vision tokens, a Qwen2-VL image processor (patch 16, merge 2) and a chat
template that renders image parts, for tests.

Built in a few seconds, deterministic for a seed, saved as float32 safetensors that transformers loads with
`AutoModelForImageTextToText`, `AutoTokenizer` and `AutoImageProcessor` (`AutoProcessor` needs torchvision, which
the CPU torch here cannot load: docs/vlm.md). A 64x64 image is 4x4 patches, merged 2x2 into 4 image tokens.
"""

import json
from pathlib import Path

from slipstream.config.vlm import VLM_MODEL_TYPES
from slipstream.models.cache import check_replaceable
from slipstream.models.tiny import MAX_POSITIONS, build_tokenizer, save_model_folder
from slipstream.models.vlm_inputs import IMAGE_PAD

VLM_FAMILIES = VLM_MODEL_TYPES
"""One tiny model per supported vision-language model type (`slipstream model tiny --family F`); each family is the
Hugging Face `model_type` its folder saves."""
_MOE_FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe")
_HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
"""Qwen3.5's text model: Gated DeltaNet (recurrent linear attention) layers between full-attention ones."""
VISION_START, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
"""Special tokens the processor and model look up by name (appended after the BPE vocabulary); Qwen3.5 uses the same
names (at other ids in its own vocabulary)."""
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 32 * 32, 128 * 128
"""Image processor bounds: at least one merged token (32x32 pixels), at most 16 (128x128), so prompts stay short."""
# ChatML as tiny.py's, with Qwen3-VL's rendering of content lists: an image part becomes one <|image_pad|> between
# vision markers, which the processor (and vLLM) expands to one token per merged patch.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' or item['type'] == 'image_url' or 'image' in item %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_vlm_tokenizer(vocab_size: int = 512):
    """tiny.py's BPE trained to `vocab_size - 4` tokens, then the four vision tokens (ids at the end)."""
    tokenizer = build_tokenizer(vocab_size - len(VISION_TOKENS))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _text_config(family: str, vocab_size: int, tokenizer) -> dict:
    """tiny.py's text shape (2 layers, hidden 128, 4/2 heads of 64) with interleaved M-RoPE. Qwen3-VL: sections
    [12, 10, 10] (half of head_dim 64, as Qwen3-VL's [24, 20, 20] is of 128). Qwen3.5: a Gated DeltaNet layer (2 key
    heads, 4 value heads of 32 dims, conv of 4 taps) then a gated full-attention layer with partial RoPE (16 of 64
    dims, Qwen3.5's 0.25) in sections [3, 3, 2]. MoE families: 8 experts of width 32 (top 2; Qwen3.5-MoE adds a gated
    shared expert of width 32), widths unlike the hidden size so that a transposed expert tensor has another shape."""
    text = dict(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [12, 10, 10], "mrope_interleaved": True}
    if family in _HYBRID_FAMILIES:
        rope = rope | {"rope_theta": 10_000_000.0, "mrope_section": [3, 3, 2], "partial_rotary_factor": 0.25}
        text |= dict(
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        )  # fmt: skip
    if family in _MOE_FAMILIES:
        text |= dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen3_5_moe":  # its text config has no dense MLP width, only the experts' and the shared one's
        text["shared_expert_intermediate_size"] = 32
    else:
        text["intermediate_size"] = 256
    return text | {"rope_parameters": rope}


def build_vlm_config(vocab_size: int, tokenizer, family: str = "qwen3_vl"):
    """The `family` model's config: text as `_text_config`; vision: 2 blocks of width 64 (2 heads), patch 16, 2x2
    merge into the text width, and for Qwen3-VL(-MoE) deepstack features from both blocks into the first two text
    layers (Qwen3.5's vision tower has no deepstack)."""
    from transformers import AutoConfig

    if family not in VLM_FAMILIES:
        raise ValueError(f"unknown tiny VLM family '{family}' (known: {', '.join(VLM_FAMILIES)})")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, out_hidden_size=128,
        num_position_embeddings=256, initializer_range=0.1,
    )  # fmt: skip
    if family not in _HYBRID_FAMILIES:
        vision["deepstack_visual_indexes"] = [0, 1]
    return AutoConfig.for_model(
        family, text_config=_text_config(family, vocab_size, tokenizer), vision_config=vision,
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END], tie_word_embeddings=False,
    )  # fmt: skip


def build_image_processor():
    """A small Qwen2-VL image processor (Qwen3-VL's kind), PIL backend: it needs no torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip


def _write_processor_files(folder: Path) -> None:
    """processor_config.json and video_preprocessor_config.json, written as JSON: transformers' Qwen3VLProcessor and
    Qwen3VLVideoProcessor cannot be built (so not saved) without torchvision, which the CPU torch here cannot load;
    a machine with torchvision (vLLM's `AutoProcessor`) reads these files."""
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE, "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "fps": 2, "min_frames": 2, "max_frames": 8,
        "do_sample_frames": True, "processor_class": "Qwen3VLProcessor",
    }  # fmt: skip
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2, sort_keys=True) + "\n")
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}) + "\n")
    image_config_path = folder / "preprocessor_config.json"
    image_config = json.loads(image_config_path.read_text()) | {"processor_class": "Qwen3VLProcessor"}
    image_config_path.write_text(json.dumps(image_config, indent=2, sort_keys=True) + "\n")


def _write_hub_expert_layout(folder: Path) -> None:
    """Rewrite a Qwen3-VL-MoE folder's fused experts in its Hub checkpoints' layout, transposed against transformers
    5's parameters: gate_up_proj [experts, hidden, 2 x width] and down_proj [experts, width, hidden]. vLLM reads that
    layout (it transposes on load) and transformers 5 accepts both (it transposes when the shapes differ), but
    transformers 5's save_pretrained writes its own."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        state[name] = state[name].transpose(1, 2).contiguous()
    save_file(state, path, metadata={"format": "pt"})


def build_tiny_vlm(out_dir: Path, seed: int = 0, vocab_size: int = 512, family: str = "qwen3_vl") -> Path:
    """Build a random tiny `family` model (one of VLM_FAMILIES) + tokenizer + image processor into `out_dir`
    (replaced atomically if a model folder)."""
    import torch
    from transformers import AutoModelForImageTextToText

    if vocab_size < 304:
        raise ValueError(f"vocab_size must be >= 304 (256 bytes + specials + vision tokens + merges), got {vocab_size}")
    out_dir = Path(out_dir).expanduser().resolve()
    check_replaceable(out_dir)
    tokenizer = build_vlm_tokenizer(vocab_size)
    if len(tokenizer) > vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    config = build_vlm_config(vocab_size, tokenizer, family)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).to(torch.float32)

    def write_processor(folder: Path) -> None:
        build_image_processor().save_pretrained(folder)
        _write_processor_files(folder)
        if family == "qwen3_vl_moe":
            _write_hub_expert_layout(folder)

    save_model_folder(model, tokenizer, out_dir, write_processor)
    return out_dir
