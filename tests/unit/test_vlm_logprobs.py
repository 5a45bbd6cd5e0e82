"""Trainer-side log-probs of tiny vision-language samples, for every family of VLM_FAMILIES (Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5, Qwen3.5-MoE): several samples with images of different sizes in one padded batch equal each sample alone and
the plain forward's (float32), the frozen vision encoder gets no gradients while the language model does, and
image-token mismatches are refused. Qwen3-VL's bfloat16 log-probs stay within the bf16 bound of float32."""

import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from slipstream.envs.count_shapes import CountShapesEnv, draw_shapes
from slipstream.models.tiny_vlm import VLM_FAMILIES, build_tiny_vlm
from slipstream.models.vlm_inputs import mm_token_type_ids, render_image_prompt
from slipstream.trainer.vlm_logprobs import VLMSample, freeze_vision_encoder, vlm_logprobs
from slipstream.utils.images import image_part


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, family):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / family, family=family)


@pytest.fixture(scope="module")
def samples(vlm_dir):
    """Three samples: two count_shapes prompts (64 px images) and one with a 96 px image, each + a few tokens."""
    tokenizer, image_processor = AutoTokenizer.from_pretrained(vlm_dir), AutoImageProcessor.from_pretrained(vlm_dir)
    prompts = [task.prompt for task in CountShapesEnv(num_tasks=2, seed=9).tasks("train")]
    big = draw_shapes([("circle", "blue", 0), ("triangle", "red", 5)], 96)
    prompts.append([{"role": "user", "content": [image_part(big), {"type": "text", "text": "Count."}]}])
    out = []
    for i, prompt in enumerate(prompts):
        rendered = render_image_prompt(tokenizer, image_processor, prompt)
        completion = tokenizer(f"<answer>{i + 2}</answer>", add_special_tokens=False)["input_ids"]
        out.append(VLMSample(rendered.token_ids + completion, rendered.pixel_values_PF, rendered.image_grid_thw_I3))
    assert len({len(s.token_ids) for s in out}) > 1
    return out


def _load(vlm_dir, dtype=torch.float32):
    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=dtype).eval()


def _reference(model, sample: VLMSample) -> torch.Tensor:
    """The plain transformers forward of one sample (the model's own logits)."""
    ids_1L = torch.tensor([sample.token_ids])
    logits_LV = model(
        input_ids=ids_1L, pixel_values=sample.pixel_values_PF, image_grid_thw=sample.image_grid_thw_I3,
        mm_token_type_ids=mm_token_type_ids(ids_1L, model.config.image_token_id),
    ).logits[0].float()  # fmt: skip
    logprobs_L = torch.log_softmax(logits_LV[:-1], -1).gather(1, ids_1L[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logprobs_L])


def test_batched_samples_equal_each_alone_and_the_plain_forward(vlm_dir, samples):
    model = _load(vlm_dir)
    with torch.no_grad():
        batched = vlm_logprobs(model, samples)
        for sample, logprobs_L in zip(samples, batched, strict=True):
            (alone_L,) = vlm_logprobs(model, [sample])
            torch.testing.assert_close(logprobs_L, alone_L, atol=1e-5, rtol=0)
            torch.testing.assert_close(logprobs_L, _reference(model, sample), atol=1e-5, rtol=0)
            assert logprobs_L[0] == 0 and (logprobs_L[1:] < 0).all()


def test_temperature_scales_the_logits(vlm_dir, samples):
    model = _load(vlm_dir)
    with torch.no_grad():
        (hot,), (plain,) = vlm_logprobs(model, samples[:1], temperature=2.0), vlm_logprobs(model, samples[:1])
    assert not torch.allclose(hot, plain)


@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_bfloat16_within_the_bf16_bound(vlm_dir, samples):
    """Qwen3-VL only: the tiny random MoE and hybrid models round further (docs/vlm.md gives their gaps)."""
    with torch.no_grad():
        fp32 = vlm_logprobs(_load(vlm_dir), samples)
        bf16 = vlm_logprobs(_load(vlm_dir, torch.bfloat16), samples)
    gap = max((a - b).abs().max().item() for a, b in zip(fp32, bf16, strict=True))
    assert 0 < gap < 5e-2, gap  # the bf16 bound of the weight check (orchestrator config)


def test_frozen_vision_encoder_gets_no_gradients(vlm_dir, samples):
    model = _load(vlm_dir).train()
    num_frozen = freeze_vision_encoder(model)
    assert num_frozen == sum(p.numel() for p in model.model.visual.parameters()) > 0
    loss = -sum(lp.sum() for lp in vlm_logprobs(model, samples))
    loss.backward()
    assert all(p.grad is None for p in model.model.visual.parameters())
    # Layer 0 is Qwen3.5's Gated DeltaNet, and an MoE layer's experts: every language weight that took part moves.
    layer_0 = {n: p for n, p in model.model.language_model.named_parameters() if n.startswith("layers.0.")}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer_0.values()), sorted(layer_0)
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_image_token_mismatch_is_refused(vlm_dir, samples):
    model = _load(vlm_dir)
    short = VLMSample(samples[0].token_ids, samples[2].pixel_values_PF, samples[2].image_grid_thw_I3)
    with pytest.raises(ValueError, match="sample 0 has 4 image tokens, but its images' grids make 9"):
        vlm_logprobs(model, [short])
    assert vlm_logprobs(model, []) == []
