"""Our GPT-OSS (gpt_oss) against transformers (CPU, float32): logits and gradients on two configs ("sliding":
alternating sliding/full layers with a window of 6 shorter than the sequences, YaRN RoPE, large sinks, a swiglu limit
low enough to clamp, 8 experts top 2; "full": full attention only, default RoPE, tied head, a padding id, 16 experts
top 4), packed rows (windows and sinks stop at sample boundaries), bit-exact weight round trips, router replay, the
registry, compile under activation checkpointing, and the refusal of expert parallelism."""

import pytest
import torch
from transformers import GptOssConfig

from slipstream.models.gpt_oss.args import GptOssArgs
from slipstream.models.gpt_oss.attention import sink_attention_mask
from slipstream.models.gpt_oss.model import GptOss, GptOssMoE
from slipstream.models.registry import MODEL_SPECS, load_pretrained, read_safetensors
from tests.unit.moe_family_helpers import MoEFamilyChecks, case_fixture, max_diff, model_dir_fixture, random_ids


def config(case: str) -> GptOssConfig:
    fields = dict(vocab_size=600, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, initializer_range=0.1, sliding_window=6,
                  swiglu_limit=0.5, bos_token_id=None, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)  # fmt: skip
    if case == "full":
        fields.update(layer_types=["full_attention"] * 3, num_hidden_layers=3, num_local_experts=16,
                      num_experts_per_tok=4, tie_word_embeddings=True, pad_token_id=0, swiglu_limit=7.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    return GptOssConfig(**fields)


def _tweak(hf) -> None:
    """Sinks large enough to take real probability mass, non-zero expert biases (transformers inits them at 0)."""
    for name, param in hf.named_parameters():
        if name.endswith("sinks"):
            param.uniform_(-1.0, 2.0)
        elif name.endswith(("gate_up_proj_bias", "down_proj_bias")):
            param.normal_(0.0, 0.1)


model_dir = model_dir_fixture("gpt_oss", config, tweak=_tweak)


case = case_fixture(["sliding", "full"])


class TestGptOssFamily(MoEFamilyChecks):
    family, model_cls, moe_cls, rich_case = "gpt_oss", GptOss, GptOssMoE, "sliding"
    unknown_key = "model.layers.0.mlp.foo"
    checkpoint_keys = ("self_attn.sinks", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias")
    num_moe_blocks, hf_keeps_bias_in_fp32 = 4, False

    def test_multi_token_prediction_layers_are_dropped_on_import(self, model_dir):
        """GPT-OSS checkpoints hold no MTP layers: layers past num_layers, like any unknown key, are refused."""
        path = model_dir("sliding")
        args = load_pretrained(path).args
        hf_sd = read_safetensors(path)
        extra = {k.replace("model.layers.3.", "model.layers.4.", 1): v for k, v in hf_sd.items() if ".layers.3." in k}
        for bad in (extra, {self.unknown_key: torch.zeros(1)}):
            with pytest.raises(ValueError, match="unexpected"):
                MODEL_SPECS[self.family].from_hf({**hf_sd, **bad}, args)


def test_configs_read_as_intended(model_dir):
    sliding = load_pretrained(model_dir("sliding"))
    args = sliding.args
    assert args.layer_types == ("sliding_attention", "full_attention") * 2 and args.sliding_window == 6
    assert args.rope.rope_type == "yarn" and args.rope.attention_factor > 1 and not args.rope.truncate
    assert [layer.attn.sliding_window for layer in sliding.layers] == [6, None, 6, None]
    full = load_pretrained(model_dir("full"))
    assert full.args.rope.rope_type == "default" and full.lm_head is None
    assert all(layer.attn.sliding_window is None for layer in full.layers)


def test_sliding_window_mask_stops_at_sample_boundaries():
    position_ids_BT = torch.cat([torch.arange(5), torch.arange(4)])[None]
    mask_TT = sink_attention_mask(position_ids_BT, 3)[0, 0]
    assert mask_TT[4].tolist() == [False, False, True, True, True] + [False] * 4
    assert mask_TT[6].tolist() == [False] * 5 + [True, True, False, False]


def test_sinks_and_window_change_the_result(case):
    """The features under test are active: zeroing the sinks, or widening the window, changes the logits."""
    name, _, ours, _ = case
    ids = random_ids(ours.args.vocab_size, 1, 24)
    positions = torch.arange(24)[None]
    with torch.no_grad():
        base = ours(ids, positions)
        saved = [layer.attn.sinks.clone() for layer in ours.layers]
        for layer in ours.layers:
            layer.attn.sinks.fill_(-1e4)
        no_sinks = ours(ids, positions)
        for layer, sinks in zip(ours.layers, saved, strict=True):
            layer.attn.sinks.copy_(sinks)
        windows = [layer.attn.sliding_window for layer in ours.layers]
        for layer in ours.layers:
            layer.attn.sliding_window = None
        no_window = ours(ids, positions)
        for layer, window in zip(ours.layers, windows, strict=True):
            layer.attn.sliding_window = window
    assert max_diff(base, no_sinks) > 1e-2, name
    assert (max_diff(base, no_window) > 1e-2) == (name == "sliding"), name


def test_expert_parallel_is_refused(model_dir):
    from slipstream.trainer.setup import check_parallel_fits_model

    class Dims:
        ep, cp = 2, 1

    model = load_pretrained(model_dir("sliding"))
    with pytest.raises(ValueError, match="trainer.parallel.ep = 2: GptOss is not supported with expert parallelism"):
        check_parallel_fits_model(Dims(), model, "custom")


def test_unsupported_layer_types_are_rejected():
    cfg = config("sliding")
    cfg.layer_types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        GptOssArgs.from_hf_config(cfg)


def test_context_parallel_shards_match_the_whole_rows(case):
    """Two context-parallel shards of packed rows, simulated in one process (shard 0's queries never see shard 1's
    keys, so zeros stand in for them; shard 1 gets shard 0's real keys and values), give the whole rows' hidden
    states: the sliding windows and sinks of the all-gathered path (attention.py) across a shard boundary that cuts a
    sample."""
    from slipstream.models.common.attention import ContextShard

    name, _, ours, _ = case
    lengths, half = (9, 17, 14), 20
    input_ids_BT = random_ids(ours.args.vocab_size, 1, sum(lengths), seed=7)
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    recorded: list[torch.Tensor] = []

    def gather_first(kv_BtX):  # shard 0: records its keys and values per layer
        recorded.append(kv_BtX)
        return torch.cat((kv_BtX, torch.zeros_like(kv_BtX)), dim=1)

    def gather_second(kv_BtX):  # shard 1: shard 0's keys and values of the same layer, in order
        return torch.cat((recorded.pop(0), kv_BtX), dim=1)

    with torch.no_grad():
        whole = ours.forward_hidden(input_ids_BT, position_ids_BT)
        shards = []
        for rank, gather in enumerate((gather_first, gather_second)):
            cols = slice(rank * half, (rank + 1) * half)
            context = ContextShard(position_ids_BT, rank * half, gather)
            shards.append(ours.forward_hidden(input_ids_BT[:, cols], position_ids_BT[:, cols], context=context))
    assert max_diff(torch.cat(shards, dim=1), whole) <= 1e-5, name
