"""The probe check of a LoRA adapter on real vLLM (CPU build) while other requests run: vLLM computes a LoRA request's
prompt log-probs with the adapter mapping of the whole batch, so scoring the probe with `prompt_logprobs` next to
running requests kills the engine (vLLM issues 16668 and 29955; the cause of a multi-tenant CI failure). The probe is
scored one forced token per request instead (InferenceClient.score_tokens_per_position): with adapter and base-model
requests in flight it matches peft's log-probs and every request completes. The last test pins the upstream bug: when
it fails, vLLM has fixed it and LoRA probes can go back to one prompt_logprobs request."""

import asyncio
import os
import sys

import httpx
import pytest
import torch

from slipstream.inference.admin_token import TOKEN_ENV
from slipstream.orchestrator.client import InferenceClient
from slipstream.rollout.client import InferenceUnavailable
from slipstream.weights.send.folder import build_probe_token_ids
from tests.e2e.helpers import free_port, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TOKEN = "lora-probe-e2e"
ADAPTER = "probe-lora"
TOLERANCE = 1e-3  # fp32 vLLM CPU vs fp32 peft: ~2e-6 measured
BACKGROUND_TOKENS = 1500
"""Tokens each background request generates (ignore_eos): it runs for seconds, across every probe request (about
5 ms a token for the tiny model on a 2-core CPU)."""


def _adapter(model_dir, folder) -> tuple[list[int], list[float]]:
    """A rank-8 PEFT adapter with random (nonzero) B matrices saved in `folder`; the probe's token ids and peft's
    log-probs of them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        model.save_pretrained(folder)
        token_ids = build_probe_token_ids(AutoTokenizer.from_pretrained(model_dir), "The quick brown fox jumps.")
        logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return token_ids, logprobs.tolist()


@pytest.fixture(scope="module")
def lora_server(tiny_qwen3_dir, tmp_path_factory):
    """`slipstream inference --model.lora.rank 8` on the tiny Qwen3: (url, probe token ids, peft log-probs), with
    the adapter loaded as ADAPTER."""
    root = tmp_path_factory.mktemp("lora_probe")
    token_ids, expected = _adapter(tiny_qwen3_dir, root / "adapter")
    port, log_path = free_port(), root / "inference.log"
    argv = [sys.executable, "-m", "slipstream", "inference", "--model.name", str(tiny_qwen3_dir), "--port", str(port)]
    argv += ["--model.lora.rank", "8", "--max_model_len", "2048", "--max_num_seqs", "8"]
    url = f"http://127.0.0.1:{port}"
    with running_server(argv, url, log_path, {**os.environ, TOKEN_ENV: TOKEN}):
        os.environ[TOKEN_ENV] = TOKEN  # the client sends it with admin calls
        try:

            async def load() -> None:
                async with InferenceClient(url, str(tiny_qwen3_dir), 60) as client:
                    await client.load_lora_adapter(ADAPTER, str(root / "adapter"))

            asyncio.run(load())
        finally:
            del os.environ[TOKEN_ENV]
        yield url, token_ids, expected


async def _with_requests_in_flight(url: str, base_model: str, score):
    """Start two adapter requests and one base-model request (BACKGROUND_TOKENS each), run `score(client)` once they
    are decoding; returns (its result or exception, the background requests' HTTP statuses)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http, InferenceClient(url, ADAPTER, 120) as client:

        async def generate(model: str) -> int:
            body = {"model": model, "prompt": "hello", "max_tokens": BACKGROUND_TOKENS, "ignore_eos": True}
            return (await http.post("/v1/completions", json=body)).status_code

        background = [asyncio.create_task(generate(m)) for m in (ADAPTER, ADAPTER, base_model)]
        await asyncio.sleep(0.5)  # prefilled and decoding
        assert not any(task.done() for task in background), "the background requests ended before the probe"
        try:
            result = await score(client)
        except InferenceUnavailable as e:
            result = e
        return result, await asyncio.gather(*background)


def test_a_lora_probe_scored_per_position_beside_running_requests(tiny_qwen3_dir, lora_server):
    url, token_ids, expected = lora_server
    got, statuses = asyncio.run(
        _with_requests_in_flight(url, str(tiny_qwen3_dir), lambda c: c.score_tokens_per_position(token_ids, "p1"))
    )
    assert statuses == [200, 200, 200]
    assert len(got) == len(expected) == len(token_ids) - 1
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= TOLERANCE
    base = asyncio.run(_score_base(url, str(tiny_qwen3_dir), token_ids))  # the adapter is what was scored
    assert max(abs(a - b) for a, b in zip(got, base, strict=True)) > 100 * TOLERANCE
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


async def _score_base(url: str, base_model: str, token_ids: list[int]) -> list[float]:
    async with InferenceClient(url, base_model, 60) as client:
        return await client.score_tokens(token_ids, "base")


def test_upstream_prompt_logprobs_of_a_lora_request_beside_running_requests_kill_the_engine(
    tiny_qwen3_dir, lora_server
):
    """Runs last in this module (it kills the shared server). Fails once vLLM fixes issue 16668: then LoRA probes
    can be scored by InferenceClient.score_tokens again (one request), and this test and the per-position path go."""
    url, token_ids, _ = lora_server
    got, statuses = asyncio.run(
        _with_requests_in_flight(url, str(tiny_qwen3_dir), lambda c: c.score_tokens(token_ids, "p2"))
    )
    assert isinstance(got, InferenceUnavailable) and "HTTP 500" in str(got), got
    assert statuses == [500, 500, 500]
