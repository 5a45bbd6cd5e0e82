"""Tiny random vision-language models, every family of VLM_FAMILIES (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE):
build, load in transformers, prompts with images rendered as Qwen3-VL's processor renders them, forward and generate
with pixel values, images that change the logits; image spans that a cut may not split, and Qwen3-VL's float32 vs
bfloat16 gap of the trainer-side log-probs."""

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, PreTrainedTokenizerFast

from slipstream.envs.count_shapes import CountShapesEnv, draw_shapes
from slipstream.models.cli import main as model_cli
from slipstream.models.tiny_vlm import IMAGE_PAD, VISION_TOKENS, VLM_FAMILIES, build_tiny_vlm
from slipstream.models.vlm_inputs import (
    check_cut_keeps_images_whole,
    expand_image_pads,
    image_spans,
    mm_token_type_ids,
    num_image_tokens,
    render_image_prompt,
)
from slipstream.utils.images import image_part

ARCHITECTURES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# transformers 5 loads a qwen3_5(_moe) folder's tokenizer as Qwen3_5Tokenizer whatever tokenizer_config.json names
# (it rebuilds the pre-tokenizer with Qwen3.5's regex); the Qwen3-VL families keep the saved one.
TOKENIZER_CLASSES = {"qwen3_vl": "TokenizersBackend", "qwen3_vl_moe": "TokenizersBackend"}


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, family):
    start = time.perf_counter()
    folder = build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / family, family=family)
    assert time.perf_counter() - start < 30
    return folder


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    image_processor = AutoImageProcessor.from_pretrained(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    return tokenizer, image_processor, model


def _messages(image) -> list[dict]:
    return [{"role": "user", "content": [image_part(image), {"type": "text", "text": "How many shapes?"}]}]


def _forward(model, prompt, token_ids=None):
    ids_1L = torch.tensor([token_ids or prompt.token_ids])
    types_1L = mm_token_type_ids(ids_1L, model.config.image_token_id)
    return model(
        input_ids=ids_1L,
        pixel_values=prompt.pixel_values_PF.to(model.dtype),
        image_grid_thw=prompt.image_grid_thw_I3,
        mm_token_type_ids=types_1L,
    ).logits[0]


def test_folder_config_and_tokenizer(family, vlm_dir, vlm):
    tokenizer, image_processor, model = vlm
    config = json.loads((vlm_dir / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"] == [ARCHITECTURES[family]]
    assert type(model).__name__ == ARCHITECTURES[family]
    assert type(tokenizer).__name__ == TOKENIZER_CLASSES.get(family, "Qwen3_5Tokenizer")
    # ... and splits text as the saved tokenizer does (same ids for a chat prompt and this file's text).
    saved = PreTrainedTokenizerFast.from_pretrained(vlm_dir)
    for text in (
        tokenizer.apply_chat_template(_messages(draw_shapes([("square", "blue", 3)], 64)), tokenize=False),
        Path(__file__).read_text(),
    ):
        assert (
            tokenizer(text, add_special_tokens=False)["input_ids"] == saved(text, add_special_tokens=False)["input_ids"]
        )
    text = config["text_config"]
    assert ("num_experts_per_tok" in text) == family.endswith("_moe")
    if family == "qwen3_vl_moe":  # the Hub's (and vLLM's) expert layout, transposed against transformers 5's
        with safe_open(vlm_dir / "model.safetensors", "pt") as f:
            saved = f.get_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj")
        fused = model.model.language_model.layers[0].mlp.experts.gate_up_proj
        assert saved.shape == (8, 128, 64) and torch.equal(saved, fused.detach().transpose(1, 2))
    assert text.get("layer_types", ["full_attention"] * 2) == (
        ["linear_attention", "full_attention"] if family.startswith("qwen3_5") else ["full_attention"] * 2
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    assert config["image_token_id"] == ids[IMAGE_PAD] and config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert len(tokenizer) <= config["text_config"]["vocab_size"] == 512
    assert (image_processor.patch_size, image_processor.merge_size) == (16, 2)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"):
        assert json.loads((vlm_dir / name).read_text())["processor_class"] == "Qwen3VLProcessor"
    assert model.config.vision_config.out_hidden_size == model.config.text_config.hidden_size
    # each vision token is one token, never split by the BPE
    assert tokenizer(IMAGE_PAD * 3, add_special_tokens=False)["input_ids"] == [ids[IMAGE_PAD]] * 3


def test_cli_build_is_deterministic(family, vlm_dir, tmp_path, capsys):
    assert model_cli(["tiny", "--family", family, "--out", str(tmp_path / "again")]) == 0
    again = tmp_path / "again"
    assert capsys.readouterr().out.strip() == str(again)
    assert (again / "model.safetensors").read_bytes() == (vlm_dir / "model.safetensors").read_bytes()


def test_prompt_expands_each_image_to_its_merged_patches(vlm):
    tokenizer, image_processor, model = vlm
    big = draw_shapes([("circle", "red", 0)], 96)  # 96 px: 6x6 patches, 9 tokens
    messages = _messages(draw_shapes([("square", "blue", 3)], 64))
    messages[0]["content"].insert(1, image_part(big))
    prompt = render_image_prompt(tokenizer, image_processor, messages)
    assert prompt.image_grid_thw_I3.tolist() == [[1, 4, 4], [1, 6, 6]]
    assert prompt.pixel_values_PF.shape == (16 + 36, 3 * 2 * 16 * 16)
    image_id = model.config.image_token_id
    spans = image_spans(prompt.token_ids, image_id)
    assert [end - start for start, end in spans] == [4, 9]
    start_id = model.config.vision_start_token_id
    assert [prompt.token_ids[start - 1] for start, _ in spans] == [start_id, start_id]
    text = tokenizer.decode(prompt.token_ids)
    assert text.startswith("<|im_start|>user\n<|vision_start|>") and text.endswith("<|im_start|>assistant\n")
    assert num_image_tokens([1, 6, 6], 2) == 9


def test_forward_and_generate_use_the_image(vlm):
    tokenizer, image_processor, model = vlm
    messages = CountShapesEnv(num_tasks=1, seed=3).tasks("train")[0].prompt
    one = render_image_prompt(tokenizer, image_processor, messages)
    other_image = draw_shapes([("circle", "red", i) for i in range(4)], 64)
    other_messages = [messages[0], {"role": "user", "content": [image_part(other_image), messages[1]["content"][1]]}]
    other = render_image_prompt(tokenizer, image_processor, other_messages)
    assert other.token_ids == one.token_ids  # same text, same image size: only the pixels differ
    ids_1L = torch.tensor([one.token_ids])
    with torch.no_grad():
        logits_LV = _forward(model, one)
        other_logits_LV = _forward(model, other)
        generated = model.generate(
            input_ids=ids_1L, pixel_values=one.pixel_values_PF, image_grid_thw=one.image_grid_thw_I3,
            mm_token_type_ids=mm_token_type_ids(ids_1L, model.config.image_token_id), max_new_tokens=6,
            do_sample=False,
        )  # fmt: skip
    assert logits_LV.shape == (len(one.token_ids), 512) and torch.isfinite(logits_LV).all()
    first_image_token = image_spans(one.token_ids, model.config.image_token_id)[0][0]
    torch.testing.assert_close(logits_LV[:first_image_token], other_logits_LV[:first_image_token])
    assert (logits_LV[-1] - other_logits_LV[-1]).abs().max() > 1e-3
    assert generated.shape[1] > ids_1L.shape[1]


def test_cut_inside_an_image_is_refused():
    tokens = [5, 6, 9, 9, 9, 9, 7, 9, 9, 8]
    assert image_spans(tokens, 9) == [(2, 6), (7, 9)]
    for cut in (1, 2, 6, 7, 9, 10):
        check_cut_keeps_images_whole(tokens, 9, cut)
    for cut in (3, 5, 8):
        with pytest.raises(ValueError, match=rf"at token {cut} would split the image .*drop the sample"):
            check_cut_keeps_images_whole(tokens, 9, cut)
    assert image_spans([9, 9], 9) == [(0, 2)]


def test_placeholder_count_must_match_images():
    assert expand_image_pads(f"a{IMAGE_PAD}b{IMAGE_PAD}", [2, 1]) == f"a{IMAGE_PAD * 2}b{IMAGE_PAD}"
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        expand_image_pads(f"a{IMAGE_PAD}b", [1, 1])


@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_bf16_logprobs_stay_within_the_bf16_bound_of_fp32(vlm_dir, vlm):
    """The trainer's bfloat16 log-probs of a sampled completion against float32's: the gap a bf16 trainer and a bf16
    vLLM must each stay within (vLLM's CPU build cannot serve Qwen3-VL here; see docs). Qwen3-VL only: the tiny random
    MoE and hybrid models round further (docs/vlm.md gives their gaps)."""
    tokenizer, image_processor, model = vlm
    prompt = render_image_prompt(
        tokenizer, image_processor, CountShapesEnv(num_tasks=1, seed=5).tasks("train")[0].prompt
    )
    ids_1L = torch.tensor([prompt.token_ids])
    types = mm_token_type_ids(ids_1L, model.config.image_token_id)
    torch.manual_seed(0)
    with torch.no_grad():
        full_1S = model.generate(
            input_ids=ids_1L, pixel_values=prompt.pixel_values_PF, image_grid_thw=prompt.image_grid_thw_I3,
            mm_token_type_ids=types, max_new_tokens=12, do_sample=True, temperature=1.0,
        )  # fmt: skip
    sequence = full_1S[0].tolist()
    num_prompt = len(prompt.token_ids)
    logprobs = {}
    for dtype in (torch.float32, torch.bfloat16):
        typed = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=dtype).eval()
        with torch.no_grad():
            logits_LV = _forward(typed, prompt, token_ids=sequence).float()
        logprobs_L = torch.log_softmax(logits_LV[:-1], dim=-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
        logprobs[dtype] = logprobs_L[num_prompt - 1 :]
    gap = (logprobs[torch.bfloat16] - logprobs[torch.float32]).abs().max().item()
    assert len(logprobs[torch.float32]) == len(sequence) - num_prompt > 0
    assert 0 < gap < 0.05, gap
