"""SFT data: chat-template rendering and loss masks checked token by token (multi-turn, tool messages, per-role
masks, prompt/completion rows, templates that cannot be masked), data order and resume cursor, packing."""

import json

import pytest
import torch

from slipstream.trainer.sft_data import (
    DataCursor,
    epoch_order,
    next_batch,
    pack_micro_batches,
    packed_micro_batch,
    rank_share,
)
from slipstream.trainer.sft_render import SFTDataError, SFTSample, load_samples, render_sample, row_messages


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _masked_runs(sample):
    """The masked spans of a sample as (start, end) pairs."""
    runs, start = [], None
    for t, m in enumerate([*sample.loss_mask, False]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


CHAT = [
    {"role": "system", "content": "You are a helpful robot."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "The answer is 7."},
    {"role": "user", "content": "And 10 plus 5?"},
    {"role": "assistant", "content": "It is 15."},
]


def test_multi_turn_masks_exactly_the_assistant_turns(tokenizer):
    sample = render_sample(tokenizer, CHAT, None, ["assistant"], "chat.jsonl:1")
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert _decode(tokenizer, sample.input_ids) == full
    spans = [_decode(tokenizer, sample.input_ids[a:b]) for a, b in _masked_runs(sample)]
    # The assistant header is the generation prompt (not trained); content and end of turn are.
    assert spans == ["The answer is 7.<|im_end|>\n", "It is 15.<|im_end|>\n"]
    before = _decode(tokenizer, sample.input_ids[: _masked_runs(sample)[0][0]])
    assert before.endswith("<|im_start|>assistant\n")


def test_tool_messages_are_masked_per_role(tokenizer):
    messages = [
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": "Let me compute it.",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"x": "6*7"}'}}],
        },
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    default = render_sample(tokenizer, messages, tools, ["assistant"], "tools.jsonl:1")
    spans = [_decode(tokenizer, default.input_ids[a:b]) for a, b in _masked_runs(default)]
    assert spans == ["Let me compute it.<|im_end|>\n", "The answer is 42.<|im_end|>\n"]
    with_tool = render_sample(tokenizer, messages, tools, ["assistant", "tool"], "tools.jsonl:1")
    spans = [_decode(tokenizer, with_tool.input_ids[a:b]) for a, b in _masked_runs(with_tool)]
    # A non-assistant message's span is its whole rendered message (header included): here it directly follows
    # the first assistant turn's span, so the two form one masked run.
    assert spans == [
        "Let me compute it.<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n",
        "The answer is 42.<|im_end|>\n",
    ]
    assert with_tool.input_ids == default.input_ids


def test_prompt_completion_rows_and_tools_as_json_string(tokenizer):
    messages, tools = row_messages({"prompt": "Reverse: cat", "completion": "tac"}, "x:1")
    assert messages == [{"role": "user", "content": "Reverse: cat"}, {"role": "assistant", "content": "tac"}]
    assert tools is None
    sample = render_sample(tokenizer, messages, tools, ["assistant"], "x:1")
    assert [_decode(tokenizer, sample.input_ids[a:b]) for a, b in _masked_runs(sample)] == ["tac<|im_end|>\n"]
    _, tools = row_messages({"messages": CHAT, "tools": json.dumps([{"type": "function"}])}, "x:2")
    assert tools == [{"type": "function"}]


def test_bad_rows_and_templates_fail_naming_the_row(tokenizer, tmp_path):
    with pytest.raises(SFTDataError, match="x:3: a row needs `messages`"):
        row_messages({"text": "hi"}, "x:3")
    with pytest.raises(SFTDataError, match="x:4: no message of a trained role"):
        render_sample(tokenizer, CHAT[:2], None, ["assistant"], "x:4")
    # A template that renders the last assistant turn differently (as reasoning templates do) cannot be masked.
    rewriting = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
        "{%- if loop.last %}{{- ' (last)' }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    original = tokenizer.chat_template
    tokenizer.chat_template = rewriting
    try:
        with pytest.raises(SFTDataError, match=r"x:5: message 2 \(assistant\): the chat template renders"):
            render_sample(tokenizer, CHAT, None, ["assistant"], "x:5")
    finally:
        tokenizer.chat_template = original
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    assert len(load_samples([path], tokenizer, ["assistant"], max_tokens=10_000)) == 2
    with pytest.raises(SFTDataError, match=f"{path}:1: .* tokens, more than micro_batch_tokens = 20"):
        load_samples([path], tokenizer, ["assistant"], max_tokens=20)


def _sample(n, num_loss, where="s"):
    return SFTSample(
        input_ids=list(range(1, n + 1)), loss_mask=[False] * (n - num_loss) + [True] * num_loss, where=where
    )


def test_packing_keeps_boundaries_and_budget():
    samples = [_sample(n, 2, where=f"s{i}") for i, n in enumerate([5, 9, 3, 7, 4, 6])]
    bins = pack_micro_batches(samples, max_tokens=12)
    assert sorted(s.where for b in bins for s in b) == sorted(s.where for s in samples)
    assert all(sum(s.num_tokens for s in b) <= 12 for b in bins)
    assert len(bins) == 3  # 34 tokens: first fit, longest first, fills 3 rows of 12
    packed = packed_micro_batch(bins[0], torch.device("cpu"))
    expected_positions = [p for s in bins[0] for p in range(s.num_tokens)]
    assert packed.position_ids_T.tolist() == expected_positions
    assert packed.loss_mask_T.tolist() == [m for s in bins[0] for m in s.loss_mask]
    assert (packed.temperatures_T == 1).all()


def test_data_order_cursor_spans_epochs_and_is_deterministic():
    order0, order1 = epoch_order(5, 0, 7, True), epoch_order(5, 1, 7, True)
    assert sorted(order0) == list(range(5)) and order0 != order1
    assert epoch_order(5, 0, 7, False) == (0, 1, 2, 3, 4)
    first, cursor = next_batch(5, DataCursor(), 3, seed=7, shuffle=True)
    second, cursor = next_batch(5, cursor, 3, seed=7, shuffle=True)
    assert first == list(order0[:3]) and second == [*order0[3:], order1[0]]
    assert cursor == DataCursor(epoch=1, index=1)
    assert next_batch(5, cursor, 2, 7, True)[0] == list(order1[1:3])
    assert rank_share([10, 11, 12, 13, 14], 1, 2) == [11, 13]
