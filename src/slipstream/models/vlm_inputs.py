"""Vision-language model inputs for Qwen3-VL-style models (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE: the same
vision tokens, image processor and M-RoPE token types): the prompt tokens with each image's placeholder expanded
to one `<|image_pad|>` per merged patch (as Qwen3VLProcessor and vLLM expand it), the image processor's pixel values
and grid sizes, the token-type ids M-RoPE needs, and the image spans a sample may never be cut inside.

Qwen3VLProcessor itself cannot be built without torchvision (its video processor needs it), so this mirrors its
image half with the tokenizer and the (PIL) image processor. Tensor legend: P patches, F flattened patch features
(channels x temporal patch x patch x patch), I images, L tokens.
"""

from dataclasses import dataclass
from typing import Any

from slipstream.utils.images import message_images

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class ImagePrompt:
    """A rendered prompt with its images, ready for the model's forward."""

    token_ids: list[int]
    """Prompt tokens, each image's placeholder expanded to `num_image_tokens` pads."""
    pixel_values_PF: Any
    """The image processor's patches of every image, concatenated in prompt order (torch float32)."""
    image_grid_thw_I3: Any
    """Per image, its grid of patches: (temporal, height, width) (torch int64)."""


def num_image_tokens(grid_thw: Any, merge_size: int) -> int:
    """Placeholder tokens of one image: its patches divided by the merge (merge_size x merge_size patches a token)."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)


def expand_image_pads(text: str, counts: list[int], image_pad: str = IMAGE_PAD) -> str:
    """`text` with its i-th `image_pad` repeated `counts[i]` times; ValueError when pads and images differ."""
    pieces = text.split(image_pad)
    if len(pieces) - 1 != len(counts):
        raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders for {len(counts)} images")
    out = pieces[0]
    for count, piece in zip(counts, pieces[1:], strict=True):
        out += image_pad * count + piece
    return out


def render_image_prompt(tokenizer: Any, image_processor: Any, messages: list[dict[str, Any]]) -> ImagePrompt:
    """Render chat `messages` (with `image_url` parts holding data URLs) as Qwen3-VL's processor does, plus the
    generation prompt."""
    images = message_images(messages)
    if not images:
        raise ValueError("the messages hold no image_url part: render text-only prompts with the tokenizer")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = image_processor(images=images, return_tensors="pt")
    grid_I3 = inputs["image_grid_thw"]
    counts = [num_image_tokens(grid, image_processor.merge_size) for grid in grid_I3]
    token_ids = tokenizer(expand_image_pads(text, counts), add_special_tokens=False)["input_ids"]
    return ImagePrompt(token_ids=token_ids, pixel_values_PF=inputs["pixel_values"], image_grid_thw_I3=grid_I3)


def mm_token_type_ids(token_ids: Any, image_token_id: int) -> Any:
    """1 at image tokens, 0 elsewhere (torch int32, the shape of `token_ids`): what Qwen3-VL's M-RoPE reads."""
    return (token_ids == image_token_id).int()


def image_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of image tokens, in order."""
    spans, start = [], None
    for i, token in enumerate(token_ids):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(token_ids)))
    return spans


def check_cut_keeps_images_whole(token_ids: list[int], image_token_id: int, cut: int) -> None:
    """Refuse to keep only `token_ids[:cut]` when the cut falls inside an image: its pixel values could no longer be
    matched with its tokens (a multimodal sample is kept whole or dropped, never truncated through an image)."""
    for start, end in image_spans(token_ids, image_token_id):
        if start < cut < end:
            raise ValueError(
                f"cutting the sample at token {cut} would split the image at tokens [{start}, {end}): drop the "
                "sample instead, or raise the length limit that cuts it"
            )
