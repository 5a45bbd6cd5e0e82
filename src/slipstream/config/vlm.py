"""`[model.vlm]`: vision-language models (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) and the checks that tie it to
the rest of the model config: bfloat16 only, a frozen vision encoder with LoRA, a supported model type."""

import json
from pathlib import Path

from slipstream.config.base import BaseConfig

VLM_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
"""Hugging Face `model_type`s of the supported vision-language checkpoints (their config.json's top level)."""


class VLMConfig(BaseConfig):
    """A vision-language model: prompts may hold images (OpenAI `image_url` parts with inline data URLs); the
    rollout carries each image with its tokens, and the trainer runs the vision encoder on the same pixels."""

    freeze_vision_encoder: bool = True
    """Keep the vision encoder's weights fixed: it is left out of the optimizer (no gradients, no optimizer state)
    and only the language model trains. false: train it too, FSDP-sharded one vision block per unit (not with
    model.lora, whose adapters cover the language model only)."""


def check_vlm_dtype(dtype: str, defaulted: bool) -> None:
    """bfloat16 only, with the reason in the error."""
    if dtype != "bfloat16":
        got = f"'{dtype}'" + (", the default" if defaulted else "")
        raise ValueError(
            f"model.dtype must be 'bfloat16' with [model.vlm] (got {got}): Qwen vision-language checkpoints are "
            "bfloat16, and the vision encoder (frozen by default, so outside the trainer's float32 master weights) "
            "runs in model.dtype in both vLLM and the trainer; image tokens' log-probs are checked against vLLM's "
            'within the bfloat16 bound only. Set model.dtype = "bfloat16"'
        )


def check_vlm_lora(vlm: VLMConfig, has_lora: bool) -> None:
    """A trained vision encoder and LoRA exclude each other: the adapters cover the language model only."""
    if has_lora and not vlm.freeze_vision_encoder:
        raise ValueError(
            "model.vlm.freeze_vision_encoder = false cannot be combined with [model.lora]: LoRA adapts the language "
            "model only and freezes every other weight, the vision encoder included; set freeze_vision_encoder = "
            "true (the default) to train adapters, or remove [model.lora] to train the vision encoder fully"
        )


def model_type_of(model_dir: Path) -> str:
    """The `model_type` of a Hugging Face model folder's config.json."""
    config_path = Path(model_dir) / "config.json"
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the model type of {model_dir} (model.path): {e}") from e
    if not isinstance(model_type, str):
        raise ValueError(f"{config_path} (model.path) has no model_type")
    return model_type


def check_vlm_model_type(model_type: str, model_name: str) -> None:
    """[model.vlm] only for the supported vision-language model types."""
    if model_type not in VLM_MODEL_TYPES:
        raise ValueError(
            f"[model.vlm] is set but model.name '{model_name}' is a '{model_type}' model, not a supported "
            f"vision-language model ({', '.join(VLM_MODEL_TYPES)}); remove [model.vlm] to train a text model, or "
            "pick a Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 or Qwen3.5-MoE checkpoint"
        )


def placeholder_token_ids(model_dir: Path) -> frozenset[int]:
    """The image and video placeholder token ids of a vision-language model folder (its config.json's
    `image_token_id` and `video_token_id`): tokens that stand for pixels in a prompt, never for text."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the placeholder tokens of {model_dir} (model.path): {e}") from e
    ids = [config.get(key) for key in ("image_token_id", "video_token_id")]
    if not isinstance(ids[0], int):
        raise ValueError(f"{config_path} (model.path) has no integer image_token_id: is it a vision-language model?")
    return frozenset(i for i in ids if isinstance(i, int))
