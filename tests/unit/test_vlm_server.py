"""The VLM stand-in server (slipstream_sim/vlm_server.py) on every tiny VLM family (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5,
Qwen3.5-MoE): its replies to a prompt with an image parse with the orchestrator's own readers (whole and streamed),
every log-prob is the model's (recomputed over the whole sequence), seeded requests repeat, prompt scoring, the
filesystem weight update loads a folder the trainer published (the probe scores as the trainer's), and refusals."""

import json

import pytest
import torch
from starlette.testclient import TestClient

from slipstream.envs.count_shapes import CountShapesEnv
from slipstream.models.tiny_vlm import VLM_FAMILIES, build_tiny_vlm
from slipstream.rollout.replies import parse_chat_response
from slipstream.rollout.streaming import StreamedChat
from slipstream_sim.vlm_server import VLMEngine, VLMServer


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, family):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / family, family=family)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    return VLMEngine(vlm_dir)


@pytest.fixture(scope="module")
def task():
    return CountShapesEnv(num_tasks=1, seed=2).tasks("train")[0]


def _body(task, **extra):
    body = {"model": "m", "messages": task.prompt, "n": 3, "temperature": 0.7, "max_completion_tokens": 6}
    return body | {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "seed": 5} | extra


def test_whole_and_streamed_replies_parse_and_hold_the_models_logprobs(engine, task):
    client = TestClient(VLMServer(engine).app)
    reply = client.post("/v1/chat/completions", json=_body(task)).json()
    rollouts = parse_chat_response(reply, task, 3, policy_version=0)
    chat = StreamedChat(3, lambda: 0, "test")
    with client.stream(
        "POST", "/v1/chat/completions", json=_body(task, stream=True, stream_options={"include_usage": True})
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chat.add(json.loads(line[len("data: ") :]))
    streamed = chat.rollouts(task, 0)
    # Seeded: the same samples either way.
    assert [r.completion_token_ids for r in streamed] == [r.completion_token_ids for r in rollouts]
    prompt_ids, images = engine.render(task.prompt)
    image_token_id = engine.model.config.image_token_id
    assert rollouts[0].prompt_token_ids == prompt_ids and prompt_ids.count(image_token_id) == 4  # a 64 px image
    for rollout in rollouts:
        ids = prompt_ids + rollout.completion_token_ids
        logits_LV = engine.logits(torch.tensor([ids]), images)[0, len(prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits_LV / 0.7, -1).gather(1, torch.tensor(ids[len(prompt_ids) :])[:, None])
        # bfloat16 forwards of 3 rows one token at a time vs 1 row at once round differently: the bf16 bound (5e-2).
        torch.testing.assert_close(torch.tensor(rollout.completion_logprobs), expected[:, 0], atol=5e-2, rtol=0)


def test_prompt_scoring_and_a_weight_update_from_a_published_folder(vlm_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from slipstream.trainer.policy import load_model
    from slipstream.weights.send.folder import publish_weights

    engine = VLMEngine(vlm_dir)  # its own: the update changes the weights
    client = TestClient(VLMServer(engine).app)
    probe = {"model": "m", "prompt": [5, 6, 7, 8, 9], "max_tokens": 1, "prompt_logprobs": 0}
    before = client.post("/v1/completions", json=probe).json()["choices"][0]["prompt_logprobs"]
    assert before[0] is None and len(before) == 5
    assert before[1]["6"]["logprob"] == pytest.approx(engine.score(probe["prompt"])[0])
    # The trainer's model (float32 masters) with a changed LM head, published in bfloat16 as a trainer step does.
    model, _ = load_model(vlm_dir, "auto", vlm=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    folder = publish_weights(
        model, AutoTokenizer.from_pretrained(vlm_dir), tmp_path, 1, probe["prompt"], torch.bfloat16, vlm_dir
    )
    info = {"update_info": {"step": 1, "path": str(folder)}}
    assert client.post("/start_weight_update").status_code == 400  # not paused
    assert client.post("/pause", params={"mode": "keep"}).status_code == 200
    assert client.post("/start_weight_update").status_code == 200
    (folder / "READY").rename(folder / "READY.later")
    assert "READY" in client.post("/update_weights", json=info).json()["message"]  # no READY marker
    (folder / "READY.later").rename(folder / "READY")
    partial = tmp_path / "partial"  # a folder without the LM head: refused, nothing loaded
    partial.mkdir()
    state = load_file(vlm_dir / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("lm_head.")}, partial / "model.safetensors")
    (partial / "READY").write_text("")
    reply = client.post("/update_weights", json={"update_info": {"step": 1, "path": str(partial)}})
    assert reply.status_code == 400 and "lm_head.weight" in reply.json()["message"]
    assert client.post("/update_weights", json=info).status_code == 200
    assert client.post("/finish_weight_update", json={"weight_version": "1"}).status_code == 200
    assert client.post("/resume").status_code == 200
    after = client.post("/v1/completions", json=probe).json()["choices"][0]["prompt_logprobs"]
    assert engine.version == 1 and after[1]["6"]["logprob"] != before[1]["6"]["logprob"]
    # The weight check: the stand-in scores the probe as the trainer's published bfloat16 copy did.
    served = [entry[str(token)]["logprob"] for entry, token in zip(after[1:], probe["prompt"][1:], strict=True)]
    expected = json.loads((folder / "probe.json").read_text())["logprobs"]
    assert served == pytest.approx(expected, abs=1e-5)


def test_refusals(engine, task):
    client = TestClient(VLMServer(engine).app)
    reply = client.post("/v1/chat/completions", json=_body(task, top_p=0.9))
    assert reply.status_code == 400 and "top_p = 1" in reply.json()["message"]
    reply = client.post("/init_weight_transfer_engine", json={"init_info": {}})
    assert reply.status_code == 400 and "filesystem" in reply.json()["message"]
