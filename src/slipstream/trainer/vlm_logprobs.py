"""Log-probs of vision-language samples (Qwen3-VL family, transformers model, trainer.model_impl "hf"): one
right-padded row per sample, every sample's images encoded in one vision pass, M-RoPE positions computed by the model
from the token types (image tokens' 3-D positions advance by the image's side, not its token count, so the packed 1-D
`position_ids` of text samples would be wrong), and the frozen vision encoder.

The training step runs packed micro-batches through logprobs.vlm_hidden instead (same padded rows and M-RoPE); this
one-call form is the reference the tests compare it with, and `freeze_vision_encoder` is what the trainer's setup
calls for `[model.vlm] freeze_vision_encoder = true`.
Tensor legend: B rows, L padded length, D hidden, V vocabulary, P patches, F patch features, I images.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class VLMSample:
    """One sample's tokens (image placeholders expanded) and the image processor's output for its images."""

    token_ids: list[int]
    pixel_values_PF: Tensor
    image_grid_thw_I3: Tensor


def freeze_vision_encoder(model: nn.Module) -> int:
    """Stop gradients into the vision encoder (`model.model.visual`, its merger and deepstack mergers included);
    returns the number of frozen parameters. The language model and LM head stay trainable."""
    visual = model.model.visual
    visual.requires_grad_(False)
    return sum(p.numel() for p in visual.parameters())


def vlm_logprobs(model: nn.Module, samples: list[VLMSample], temperature: float = 1.0) -> list[Tensor]:
    """Per sample, logprobs_L: log p(token t | tokens before it and the sample's images) at `temperature`, 0 at the
    first token; gradients flow through them. Samples never attend to each other (right padding + attention mask)."""
    if not samples:
        return []
    config = model.config
    lengths = [len(s.token_ids) for s in samples]
    input_ids_BL = torch.zeros(len(samples), max(lengths), dtype=torch.long)
    attention_mask_BL = torch.zeros_like(input_ids_BL)
    for b, sample in enumerate(samples):
        input_ids_BL[b, : lengths[b]] = torch.tensor(sample.token_ids)
        attention_mask_BL[b, : lengths[b]] = 1
    _check_image_tokens(samples, config)
    out = model.model(
        input_ids=input_ids_BL,
        attention_mask=attention_mask_BL,
        pixel_values=torch.cat([s.pixel_values_PF for s in samples]).to(model.dtype),
        image_grid_thw=torch.cat([s.image_grid_thw_I3 for s in samples]),
        mm_token_type_ids=(input_ids_BL == config.image_token_id).int() * attention_mask_BL,
        use_cache=False,
    )
    logits_BLV = model.lm_head(out.last_hidden_state[:, :-1]).float() / temperature
    logprobs_BL = torch.log_softmax(logits_BLV, dim=-1).gather(-1, input_ids_BL[:, 1:, None])[..., 0]
    zero_B1 = torch.zeros(len(samples), 1, dtype=logprobs_BL.dtype)
    logprobs_BL = torch.cat([zero_B1, logprobs_BL], dim=1)
    return [logprobs_BL[b, : lengths[b]] for b in range(len(samples))]


def _check_image_tokens(samples: list[VLMSample], config) -> None:
    """Each sample's image tokens must be exactly its images' merged patches: a mismatch would silently pair pixels
    with the wrong sample's tokens."""
    merge = config.vision_config.spatial_merge_size
    for b, sample in enumerate(samples):
        expected = int(sample.image_grid_thw_I3.prod(-1).sum()) // (merge * merge)
        got = sum(t == config.image_token_id for t in sample.token_ids)
        if got != expected:
            raise ValueError(f"sample {b} has {got} image tokens, but its images' grids make {expected}")
