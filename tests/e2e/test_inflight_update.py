"""An in-flight weight update on real vLLM (CPU build): a long streamed request (n = 2) keeps running across
pause(keep) -> load -> resume driven by the orchestrator's WeightRelay. It completes with all the tokens it asked
for, its tokens are stamped v0 then v1, the update's probe check passes, and every token's log-prob is what the
trainer computes: the old weights for v0 tokens; for v1 tokens the new weights reading the KV cache the old weights
wrote (nothing is recomputed at resume).

The server is shared with test_admin_endpoints_need_the_token (moved here from test_inference_admin.py): one vLLM
start (~25 s on the 2-core CI machine) for both tests."""

import asyncio
import os
import sys

import httpx
import pytest
import torch

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.inference.admin_token import HEADER, TOKEN_ENV
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.weights import WeightRelay
from slipstream.rollout.record import cache_salt
from slipstream.rollout.streaming import StreamedChat
from slipstream.rundir import WEIGHT_CHECKS_FILE
from slipstream.weights.send.folder import build_probe_token_ids, publish_weights
from tests.e2e.helpers import free_port, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_TOKENS = 400
"""Tokens asked per choice (ignore_eos): the update lands after TOKENS_BEFORE_UPDATE, far from the end."""
TOKENS_BEFORE_UPDATE = 16
TOLERANCE = 1e-3  # fp32 vLLM CPU vs fp32 transformers: ~1e-5 in practice (see test_rl_tiny.py)
MESSAGES = [{"role": "user", "content": "Count slowly from one to one hundred, one number per line."}]


TOKEN = "inflight-e2e"


def server_argv(model_dir, port: int) -> list[str]:
    argv = [sys.executable, "-m", "slipstream", "inference", "--model.name", str(model_dir), "--port", str(port)]
    return argv + ["--max_model_len", "1024", "--max_num_seqs", "4"]


@pytest.fixture(scope="module")
def tiny_server(tiny_qwen3_dir, tmp_path_factory):
    """`slipstream inference` on the tiny Qwen3 with admin token TOKEN, started once for this module's tests: its URL.
    The admin test leaves it resumed and serving the model's own weights; only the in-flight test loads others."""
    port, log_path = free_port(), tmp_path_factory.mktemp("inference") / "inference.log"
    url = f"http://127.0.0.1:{port}"
    with running_server(server_argv(tiny_qwen3_dir, port), url, log_path, {**os.environ, TOKEN_ENV: TOKEN}):
        yield url


def test_admin_endpoints_need_the_token(tiny_server):
    """The real vLLM server started by `slipstream inference` rejects admin calls without the run's token."""
    url = tiny_server
    for path in ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache"):
        assert httpx.post(f"{url}{path}", timeout=10).status_code == 401, path
        assert httpx.post(f"{url}{path}", headers={HEADER: "wrong"}, timeout=10).status_code == 401, path
    good = {HEADER: TOKEN}
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, headers=good, timeout=30).status_code == 200
    assert httpx.get(f"{url}/is_paused", headers=good, timeout=10).json() == {"is_paused": True}
    assert httpx.post(f"{url}/resume", headers=good, timeout=30).status_code == 200
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200  # inference routes stay open


def perturbed_copy(model_dir, output_dir) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model (old) and a perturbed copy published as weights/step_1 (new), both fp32 in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    old = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(0.05 * param.abs().mean() * torch.randn(param.shape, generator=generator))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probe = build_probe_token_ids(tokenizer, "The quick brown fox jumps over the lazy dog.")
    publish_weights(new, tokenizer, output_dir, 1, probe, source_dir=model_dir)
    return old, new


@torch.no_grad()
def expected_logprobs(old, new, prompt_ids: list[int], completion_ids: list[int], num_old: int) -> list[float]:
    """Log-prob of each completion token as vLLM computes it across the update: tokens [0, num_old) are sampled by
    the old weights; at resume the new weights run from the last old token on, attending to the KV cache the old
    weights wrote for everything before it."""
    ids = torch.tensor([prompt_ids + completion_ids])
    split = len(prompt_ids) + num_old - 1  # positions < split keep their old-weights KV
    head = old(ids[:, :split], use_cache=True)
    tail = new(ids[:, split:], past_key_values=head.past_key_values, use_cache=True)
    logits = torch.cat([head.logits, tail.logits], dim=1)[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return logprobs[len(prompt_ids) - 1 :].tolist()


def test_a_streamed_request_continues_across_an_inflight_update(tiny_qwen3_dir, tmp_path, monkeypatch, tiny_server):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the orchestrator's client sends it with admin calls
    url, out = tiny_server, tmp_path / "run"
    old, new = perturbed_copy(tiny_qwen3_dir, out)
    config = OrchestratorConfig(
        model={"name": str(tiny_qwen3_dir)}, output_dir=out, max_steps=1, inference_url=url,
        weight_check={"max_abs_diff": TOLERANCE},
    )  # fmt: skip
    chat, at_update, instance = asyncio.run(stream_across_update(config))

    assert instance is not None  # the server names its start (X-Slipstream-Instance), for restart detection
    prompt_ids = chat.check_complete("inflight")  # every choice finished, usage counts every streamed token
    check = [line for line in (out / WEIGHT_CHECKS_FILE).read_text().splitlines() if line]
    assert len(check) == 1 and '"passed": true' in check[0] and '"step": 1' in check[0]
    for i, choice in enumerate(chat.choices):
        assert choice.finish_reason == "length" and len(choice.token_ids) == MAX_TOKENS  # no abort, no restart
        assert at_update[i] >= TOKENS_BEFORE_UPDATE
        num_old = choice.versions.count(0)
        assert choice.versions == [0] * num_old + [1] * (MAX_TOKENS - num_old), "stamps must go v0 then v1"
        assert at_update[i] <= num_old < MAX_TOKENS, (at_update[i], num_old)  # both versions present
        want = expected_logprobs(old, new, prompt_ids, choice.token_ids, num_old)
        diffs = [abs(a - b) for a, b in zip(choice.logprobs, want, strict=True)]
        assert max(diffs[:num_old]) <= TOLERANCE, f"choice {i}: v0 tokens vs old weights: {max(diffs[:num_old])}"
        assert max(diffs[num_old:]) <= TOLERANCE, f"choice {i}: v1 tokens vs new weights: {max(diffs[num_old:])}"
        all_old = expected_logprobs(old, old, prompt_ids, choice.token_ids, MAX_TOKENS)
        assert (
            max(abs(a - b) for a, b in zip(choice.logprobs[num_old:], all_old[num_old:], strict=True)) > 10 * TOLERANCE
        )


async def stream_across_update(config: OrchestratorConfig) -> tuple[StreamedChat, list[int], str | None]:
    """Stream the request; once every choice has TOKENS_BEFORE_UPDATE tokens, run the relay's update to v1."""
    async with InferenceClient(config.inference_url, config.model.name, request_timeout_s=300) as client:
        instance = await client.wait_healthy(60)
        relay = WeightRelay(client, config)
        chat = StreamedChat(2, lambda: relay.served_version, f"{config.inference_url} (stream)")
        sampling = {"temperature": 1.0, "max_completion_tokens": MAX_TOKENS, "ignore_eos": True}
        reached = asyncio.Event()

        async def consume() -> None:
            async for chunk in client.stream_chat(MESSAGES, sampling, 2, cache_salt(0)):
                chat.add(chunk)
                if min(len(c.token_ids) for c in chat.choices) >= TOKENS_BEFORE_UPDATE:
                    reached.set()

        streaming = asyncio.create_task(consume())
        waiter = asyncio.create_task(reached.wait())
        await asyncio.wait([streaming, waiter], return_when=asyncio.FIRST_COMPLETED)
        assert reached.is_set() and not streaming.done(), "the stream ended before the update could start"
        at_update = [len(c.token_ids) for c in chat.choices]
        await relay.update(1)  # pause(keep) -> load -> reset prefix cache -> resume, then the probe check
        await streaming
        return chat, at_update, instance
