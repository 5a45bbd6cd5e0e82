"""A tiny random Qwen3-VL (vision tower + text model) with tiny.py's byte-level BPE tokenizer plus Qwen3-VL's vision
tokens, a Qwen2-VL image processor (patch 16, merge 2) and a chat template that renders image parts, for tests.

Built in a few seconds, deterministic for a seed, saved as float32 safetensors that transformers loads with
`Qwen3VLForConditionalGeneration`, `AutoTokenizer` and `AutoImageProcessor` (`AutoProcessor` needs torchvision, which
the CPU torch here cannot load: docs/vlm.md). A 64x64 image is 4x4 patches, merged 2x2 into 4 image tokens.
"""

import json
from pathlib import Path

from slipstream.models.cache import check_replaceable
from slipstream.models.tiny import MAX_POSITIONS, build_tokenizer, save_model_folder
from slipstream.models.vlm_inputs import IMAGE_PAD

VLM_FAMILY = "qwen3_vl"
"""`slipstream model tiny --family qwen3_vl` builds this module's model."""
VISION_START, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
"""Special tokens Qwen3-VL's processor and model look up by name (appended after the BPE vocabulary)."""
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
    """tiny.py's BPE trained to `vocab_size - 4` tokens, then Qwen3-VL's four vision tokens (ids at the end)."""
    tokenizer = build_tokenizer(vocab_size - len(VISION_TOKENS))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_vlm_config(vocab_size: int, tokenizer):
    """Text: tiny.py's shape (2 layers, hidden 128, 4/2 heads of 64) with interleaved M-RoPE sections [12, 10, 10]
    (half of head_dim 64, as Qwen3-VL's [24, 20, 20] is of 128). Vision: 2 blocks of width 64 (2 heads), patch 16,
    2x2 merge into the text width, deepstack features from both blocks into the first two text layers."""
    from transformers import Qwen3VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    text = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
        initializer_range=0.1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [12, 10, 10],
                         "mrope_interleaved": True},
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, out_hidden_size=128,
        num_position_embeddings=256, deepstack_visual_indexes=[0, 1], initializer_range=0.1,
    )  # fmt: skip
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END], tie_word_embeddings=False,
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


def build_tiny_vlm(out_dir: Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """Build a random tiny Qwen3-VL + tokenizer + processor into `out_dir` (replaced atomically if a model folder)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    if vocab_size < 304:
        raise ValueError(f"vocab_size must be >= 304 (256 bytes + specials + vision tokens + merges), got {vocab_size}")
    out_dir = Path(out_dir).expanduser().resolve()
    check_replaceable(out_dir)
    tokenizer = build_vlm_tokenizer(vocab_size)
    if len(tokenizer) > vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    config = build_vlm_config(vocab_size, tokenizer)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)

    def write_processor(folder: Path) -> None:
        build_image_processor().save_pretrained(folder)
        _write_processor_files(folder)

    save_model_folder(model, tokenizer, out_dir, write_processor)
    return out_dir
