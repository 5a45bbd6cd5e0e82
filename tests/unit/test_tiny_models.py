"""Tiny random models: build, load in transformers, forward, tokenizer round-trip and chat template, determinism."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slipstream.models.tiny import FAMILIES, IM_END, build_tiny_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 plus 7?"}]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_forwards(tiny_model_factory, family):
    folder = tiny_model_factory(family)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == family
    assert model.dtype == torch.float32
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], 512)
    assert torch.isfinite(logits).all()
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= ids["input_ids"].shape[1] + 4


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_matches_tokenizer(tiny_model_factory, family):
    folder = tiny_model_factory(family)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    assert tokenizer.eos_token == IM_END
    assert config["eos_token_id"] == generation["eos_token_id"] == tokenizer.eos_token_id
    assert config["pad_token_id"] == generation["pad_token_id"] == tokenizer.pad_token_id
    assert len(tokenizer) <= config["vocab_size"]


def test_moe_and_tying_layout(tiny_model_factory):
    moe = AutoConfig.from_pretrained(tiny_model_factory("qwen3_moe"))
    assert (moe.num_experts, moe.num_experts_per_tok) == (8, 2)
    assert json.loads((tiny_model_factory("qwen3_moe") / "config.json").read_text())["num_experts"] == 8
    assert "lm_head.weight" in load_file(tiny_model_factory("qwen3_moe") / "model.safetensors")
    assert "lm_head.weight" not in load_file(tiny_model_factory("llama") / "model.safetensors")


def test_tokenizer_round_trip_and_specials(tiny_qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    for text in ["Hello world, 12 + 30 = 42.", "  tabs\tand\nnewlines  ", "unicode: héllo wörld, 你好 🙂"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]
    assert tokenizer.decode(tokenizer.encode("<|im_end|>hi"), skip_special_tokens=True) == "hi"


def test_chat_template(tiny_qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    chat = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n"
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == chat
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == chat + "<|im_start|>assistant\n"


def test_same_seed_same_weights(tmp_path):
    a = load_file(build_tiny_model("qwen3", tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(build_tiny_model("qwen3", tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(build_tiny_model("qwen3", tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_rebuild_replaces_model_folder_only(tmp_path):
    folder = build_tiny_model("llama", tmp_path / "m")
    assert build_tiny_model("llama", folder, seed=1) == folder
    assert not list(tmp_path.glob(".m.tmp-*"))
    other = tmp_path / "not_a_model"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a model folder"):
        build_tiny_model("llama", other)
    assert (other / "notes.txt").exists()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt9'.*llama, qwen3, qwen3_moe"):
        build_tiny_model("gpt9", tmp_path / "x")
    with pytest.raises(ValueError, match="vocab_size must be >= 300"):
        build_tiny_model("qwen3", tmp_path / "x", vocab_size=100)
