"""Images inside chat messages: PNG data URLs in OpenAI `image_url` content parts, the form images travel in from an
environment's prompt to vLLM's chat API and (decoded again) to the trainer's image processor."""

import base64
import binascii
import io
from typing import Any

_PNG_PREFIX = "data:image/png;base64,"


def png_data_url(image: Any) -> str:
    """A PIL image as a `data:image/png;base64,...` URL (PNG is lossless and deterministic for the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return _PNG_PREFIX + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_part(image: Any) -> dict[str, Any]:
    """An OpenAI chat content part carrying `image` inline."""
    return {"type": "image_url", "image_url": {"url": png_data_url(image)}}


def data_url_bytes(url: str) -> bytes:
    """The image file (PNG, JPEG, ...) a base64 `data:image/...` URL holds, still encoded; ValueError for any other
    URL (remote images are not fetched: a rollout's images must be reproducible from the rollout alone)."""
    if not url.startswith("data:image/") or ";base64," not in url:
        raise ValueError(f"only inline base64 image data URLs are supported, got {url[:60]!r}")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except binascii.Error as e:
        raise ValueError(f"image data URL is not valid base64: {e}") from e


def decode_image_bytes(data: bytes) -> Any:
    """The RGB PIL image of an encoded image file."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def decode_data_url(url: str) -> Any:
    """The RGB PIL image of a base64 `data:image/...` URL; ValueError for any other URL (see data_url_bytes)."""
    return decode_image_bytes(data_url_bytes(url))


def message_image_bytes(messages: list[dict[str, Any]]) -> list[bytes]:
    """The encoded image files of `messages`' `image_url` parts, in prompt order (the order of their placeholders):
    what a rollout carries to the trainer, which decodes them with the model's image processor."""
    images = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            images += [data_url_bytes(p["image_url"]["url"]) for p in content if p.get("type") == "image_url"]
    return images


def message_images(messages: list[dict[str, Any]]) -> list[Any]:
    """The images of `messages`' `image_url` parts, decoded, in prompt order (the order of their placeholders)."""
    return [decode_image_bytes(data) for data in message_image_bytes(messages)]
