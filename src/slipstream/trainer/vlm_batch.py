"""Vision-language micro-batches on the trainer: the image files a MicroBatch carries (MicroBatch.images) decoded and
run through the model folder's image processor into the pixel values and grid sizes the model's forward takes, with
the check that each sample's image tokens are exactly its images' merged patches.

Legend: P patches (all images of the micro-batch, in token order), F flattened patch features, I images.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from slipstream.trainer.data import MicroBatchError
from slipstream.transport.rollouts import MicroBatch
from slipstream.utils.images import decode_image_bytes


@dataclass(frozen=True)
class ImageInputs:
    """A micro-batch's images as the vision-language model takes them (samples' images in token order)."""

    pixel_values_PF: Tensor
    image_grid_thw_I3: Tensor
    image_token_id: int
    """The token each image's placeholder is expanded into (M-RoPE's token types are read from it)."""


class ImageProcessorInputs:
    """Builds ImageInputs for micro-batches with the image processor of the model folder (`AutoImageProcessor`,
    the same preprocessing inference applies to the prompt's image files)."""

    def __init__(self, model_dir: Path, image_token_id: int, merge_size: int) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.image_token_id, self.merge_size = image_token_id, merge_size

    @classmethod
    def from_config(cls, model_dir: Path, hf_config) -> "ImageProcessorInputs":
        return cls(model_dir, hf_config.image_token_id, hf_config.vision_config.spatial_merge_size)

    def __call__(self, mb: MicroBatch, device: torch.device) -> ImageInputs | None:
        """The micro-batch's ImageInputs on `device` (None without images); MicroBatchError when a sample's image
        tokens do not match its images (a sample cut inside an image, or images of another prompt)."""
        ids_T = torch.tensor(mb.input_ids)
        is_image_T = ids_T == self.image_token_id
        if not mb.images:
            if is_image_T.any():
                raise MicroBatchError(
                    f"the micro-batch holds {int(is_image_T.sum())} image tokens but no images: the orchestrator "
                    "must send each sample's images with it (MicroBatch.images)"
                )
            return None
        images = [decode_image_bytes(data) for sample in mb.images for data in sample.images]
        inputs = self.processor(images=images, return_tensors="pt")
        grid_I3 = inputs["image_grid_thw"]
        tokens_I = grid_I3.prod(-1) // (self.merge_size * self.merge_size)
        first = 0
        for sample in mb.images:
            expected = int(tokens_I[first : first + len(sample.images)].sum())
            got = int(is_image_T[sample.start : sample.start + sample.num_tokens].sum())
            if got != expected:
                raise MicroBatchError(
                    f"the sample at tokens [{sample.start}, {sample.start + sample.num_tokens}) has {got} image tokens "
                    f"but its {len(sample.images)} image(s) make {expected}: a sample must keep its images whole "
                    "(never cut inside one) and be rendered with the model's own image processor"
                )
            first += len(sample.images)
        if int(is_image_T.sum()) != int(tokens_I.sum()):
            raise MicroBatchError("the micro-batch holds image tokens outside its samples with images")
        return ImageInputs(inputs["pixel_values"].to(device), grid_I3.to(device), self.image_token_id)
