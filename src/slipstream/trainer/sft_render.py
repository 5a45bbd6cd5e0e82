"""SFT rows -> token ids + loss mask: read JSONL/Parquet rows, render them with the model's chat template, and mark
the loss tokens of the trained roles, checked token by token against the rendered text.

A message's tokens are found by rendering the conversation's prefixes: message i spans what the template adds
between `render(messages[:i])` (for an assistant message: with the generation prompt, so the model is trained on
exactly what it generates at inference) and `render(messages[:i + 1])`. This needs a template that renders every
prefix as a prefix of the whole conversation, and a tokenizer that tokenizes each prefix as a prefix of the whole
token sequence; both are checked, and the masked tokens must decode exactly to the message's rendered text and
contain its content. Any failure is an SFTDataError naming the row and the message.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class SFTDataError(ValueError):
    """A data row that cannot be trained on as it is; the message names the row ("file:line")."""


@dataclass(frozen=True)
class SFTSample:
    """One rendered conversation: input_ids[t] is trained on (predicted from input_ids[:t]) where loss_mask[t]."""

    input_ids: list[int]
    loss_mask: list[bool]
    where: str
    """The row it came from, "file:line" (JSONL) or "file:row N" (Parquet)."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of every row of a `.jsonl` or `.parquet` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file {path} does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise SFTDataError(f"{path}: reading Parquet files needs pyarrow (pip install pyarrow)") from e
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
        return
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SFTDataError(f"{path}:{number}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise SFTDataError(f"{path}:{number}: a row must be a JSON object, got {type(row).__name__}")
            yield f"{path}:{number}", row


def row_messages(row: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools) of a row with `messages` (+ `tools`) or `prompt` + `completion`."""
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        messages = [*prompt, *completion] if isinstance(prompt, list) and isinstance(completion, list) else None
    else:
        raise SFTDataError(f"{where}: a row needs `messages`, or `prompt` and `completion` (got keys {sorted(row)})")
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(f"{where}: the messages must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise SFTDataError(f"{where}: message {i} must be an object with a string `role` (got {message!r:.200})")
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise SFTDataError(f"{where}: `tools` is a string but not JSON ({e})") from e
    if tools is not None and not isinstance(tools, list):
        raise SFTDataError(f"{where}: `tools` must be a list of tool schemas (got {type(tools).__name__})")
    return messages, tools or None


def render_sample(
    tokenizer: "PreTrainedTokenizerBase",
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    loss_roles: list[str],
    where: str,
) -> SFTSample:
    """Render `messages` with the chat template and mark the tokens of messages whose role is in `loss_roles`."""
    full_text = _render(tokenizer, messages, tools, add_generation_prompt=False, where=where)
    input_ids = _encode(tokenizer, full_text)
    if _decode(tokenizer, input_ids) != full_text:
        raise SFTDataError(f"{where}: the tokenizer does not decode the rendered conversation back to its text")
    loss_mask = [False] * len(input_ids)
    for i, message in enumerate(messages):
        if message["role"] not in loss_roles:
            continue
        start, end = _message_span(tokenizer, messages, tools, i, full_text, input_ids, where)
        if start == 0:
            raise SFTDataError(
                f"{where}: message {i} ({message['role']}) starts the rendered text, so nothing precedes its first "
                "token to predict it; add a system or user message before it"
            )
        loss_mask[start:end] = [True] * (end - start)
    if not any(loss_mask):
        raise SFTDataError(f"{where}: no message of a trained role ({', '.join(loss_roles)}), so no loss tokens")
    return SFTSample(input_ids=input_ids, loss_mask=loss_mask, where=where)


def _message_span(
    tokenizer: "PreTrainedTokenizerBase",
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    i: int,
    full_text: str,
    input_ids: list[int],
    where: str,
) -> tuple[int, int]:
    """[start, end) token indices of message i, checked against the rendered text (see the module docstring)."""
    message = messages[i]
    what = f"{where}: message {i} ({message['role']})"
    is_assistant = message["role"] == "assistant"
    start_text = _render(tokenizer, messages[:i], tools, add_generation_prompt=is_assistant, where=where)
    end_text = _render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False, where=where)
    if not (full_text.startswith(end_text) and end_text.startswith(start_text)):
        raise SFTDataError(
            f"{what}: the chat template renders the conversation up to this message differently from the start of "
            "the whole conversation (e.g. it rewrites earlier turns, like dropping reasoning from past assistant "
            "turns), so its tokens cannot be located; use a template that renders turns incrementally, or train "
            "on conversations that end with this message"
        )
    start_ids, end_ids = _encode(tokenizer, start_text), _encode(tokenizer, end_text)
    start, end = len(start_ids), len(end_ids)
    if input_ids[:start] != start_ids or input_ids[:end] != end_ids:
        raise SFTDataError(
            f"{what}: tokens merge across the message boundary (the prefix before or after it tokenizes differently "
            "alone than inside the conversation), so the trained tokens would differ from what the model generates"
        )
    span_text = end_text[len(start_text) :]
    if _decode(tokenizer, input_ids[start:end]) != span_text:
        raise SFTDataError(f"{what}: its tokens do not decode exactly to its rendered text {span_text!r:.200}")
    content = message.get("content")
    if isinstance(content, str) and content.strip() and content.strip() not in span_text:
        raise SFTDataError(
            f"{what}: the chat template does not render its content inside its own span (rendered: "
            f"{span_text!r:.200}); this template cannot be trained on this role"
        )
    return start, end


def _render(
    tokenizer: "PreTrainedTokenizerBase",
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    add_generation_prompt: bool,
    where: str,
) -> str:
    if not messages and not add_generation_prompt:
        return ""
    kwargs = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as e:  # jinja2 errors and raise_exception() of the template: name the row
        if not messages:
            return ""  # templates that index messages[0] cannot render an empty conversation; nothing precedes it
        raise SFTDataError(f"{where}: the chat template failed on this row: {type(e).__name__}: {e}") from e
    return text


def _encode(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    # The template writes any BOS itself; the tokenizer must not add another.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _decode(tokenizer: "PreTrainedTokenizerBase", ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def load_samples(
    files: list[Path], tokenizer: "PreTrainedTokenizerBase", loss_roles: list[str], max_tokens: int
) -> list[SFTSample]:
    """Every row of `files`, rendered; a sample longer than `max_tokens` is an error naming its row."""
    samples = []
    for path in files:
        for where, row in read_rows(path):
            messages, tools = row_messages(row, where)
            sample = render_sample(tokenizer, messages, tools, loss_roles, where)
            if sample.num_tokens > max_tokens:
                raise SFTDataError(
                    f"{where}: {sample.num_tokens} tokens, more than micro_batch_tokens = {max_tokens}; raise "
                    "micro_batch_tokens or drop or shorten this row"
                )
            samples.append(sample)
    if not samples:
        raise SFTDataError(f"no rows in {', '.join(map(str, files))}")
    return samples
