"""The trainer's vision-language path on every tiny VLM family (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE):
count_shapes rollouts packed by the orchestrator into micro-batches with images give, through the Policy, the
log-probs of each sample alone (vlm_logprobs); a train step with the frozen vision encoder moves the language model
only, and its published weights keep the checkpoint's names and load back as the trained ones; a trained vision
encoder moves; text models and mismatched images are refused."""

import msgspec
import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer

from slipstream.config.trainer import LossConfig
from slipstream.envs.count_shapes import CountShapesEnv
from slipstream.models.tiny_vlm import VLM_FAMILIES, build_tiny_vlm
from slipstream.models.vlm_inputs import render_image_prompt
from slipstream.orchestrator.batching import build_training_batches
from slipstream.rollout.record import Rollout
from slipstream.trainer.data import MicroBatchError, to_packed
from slipstream.trainer.policy import Policy, load_model
from slipstream.trainer.step import train_step
from slipstream.trainer.vlm_batch import ImageProcessorInputs
from slipstream.trainer.vlm_logprobs import VLMSample, freeze_vision_encoder, vlm_logprobs
from slipstream.utils.images import decode_image_bytes

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, family):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / family, family=family)


@pytest.fixture(scope="module")
def rollouts(vlm_dir):
    """Two groups of two count_shapes rollouts, prompts rendered as inference renders them, made-up completions."""
    tokenizer, processor = AutoTokenizer.from_pretrained(vlm_dir), AutoImageProcessor.from_pretrained(vlm_dir)
    out = []
    for g, task in enumerate(CountShapesEnv(num_tasks=2, seed=4).tasks("train")):
        prompt_ids = render_image_prompt(tokenizer, processor, task.prompt).token_ids
        for i in range(2):
            completion = tokenizer(f"<answer>{g + i + 1}</answer>", add_special_tokens=False)["input_ids"]
            out.append(
                Rollout(
                    task=task,
                    prompt_token_ids=prompt_ids,
                    completion_token_ids=completion,
                    completion_logprobs=[-1.0] * len(completion),
                    completion_text="",
                    token_versions=[0] * len(completion),
                    request_version=0,
                    advantage=1.0 if i else -1.0,
                    group_index=g,
                )
            )
    return out


def _batch(rollouts):
    (batch,) = build_training_batches(1, rollouts, 1.0, micro_batch_tokens=4096, num_ranks=1, metrics={})
    assert len(batch.micro_batches) == 1 and len(batch.micro_batches[0].images) == len(rollouts)
    return batch


def _model(vlm_dir):
    model, impl = load_model(vlm_dir, "auto", vlm=True)
    assert impl == "hf"
    return model


def test_policy_logprobs_of_a_packed_micro_batch_equal_each_sample_alone(vlm_dir, rollouts):
    model = _model(vlm_dir).eval()
    image_inputs = ImageProcessorInputs.from_config(vlm_dir, model.config)
    (mb,) = _batch(rollouts).micro_batches
    packed = to_packed(mb, CPU)
    with torch.no_grad():
        logprobs_T, _ = Policy(model)(
            packed.input_ids_T, packed.position_ids_T, packed.temperatures_T, images=image_inputs(mb, CPU)
        )
        processor = image_inputs.processor
        for entry in mb.images:
            inputs = processor(images=[decode_image_bytes(b) for b in entry.images], return_tensors="pt")
            tokens = mb.input_ids[entry.start : entry.start + entry.num_tokens]
            (alone_L,) = vlm_logprobs(model, [VLMSample(tokens, inputs["pixel_values"], inputs["image_grid_thw"])])
            got_L = logprobs_T[entry.start : entry.start + entry.num_tokens]
            torch.testing.assert_close(got_L, alone_L, atol=5e-5, rtol=0)  # float32 summation order


def test_train_step_with_a_frozen_vision_encoder_moves_the_language_model_only(vlm_dir, rollouts, tmp_path):
    model = _model(vlm_dir)
    assert freeze_vision_encoder(model) > 0
    policy = Policy(model)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    assert not any(p is q for g in optimizer.param_groups for p in g["params"] for q in model.model.visual.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    image_inputs = ImageProcessorInputs.from_config(vlm_dir, model.config)
    metrics = train_step(
        policy, optimizer, _batch(rollouts), LossConfig(), 10.0, CPU, torch.bfloat16, image_inputs=image_inputs
    )
    assert metrics["num_loss_tokens"] > 0 and metrics["grad_norm"] > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(not n.startswith("model.visual.") for n in changed)
    assert any(n.startswith("model.language_model.layers.") for n in changed)
    _check_published_round_trip(model, vlm_dir, tmp_path)


def _check_published_round_trip(model, vlm_dir, tmp_path) -> None:
    """Published (bfloat16) weights hold the checkpoint's tensor names and load back through transformers as the
    trained weights, rounded."""
    from transformers import AutoModelForImageTextToText

    folder = _publish(model, vlm_dir, tmp_path)
    assert (
        _tensor_shapes(sorted(folder.glob("*.safetensors"))).keys()
        == _tensor_shapes([vlm_dir / "model.safetensors"]).keys()
    )
    loaded = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
    for name, param in model.state_dict().items():
        assert torch.equal(loaded[name], param.to(torch.bfloat16)), name


def test_published_tensors_have_the_checkpoints_layout(family, vlm_dir, tmp_path):
    """What inference reloads must be laid out as the checkpoint it loaded first: same names and shapes (MoE experts
    per expert for Qwen3.5-MoE, as save_pretrained writes them; Qwen3-VL-MoE's fused experts transposed back from
    transformers' layout, as the checkpoint holds them). That the values load back: the train-step test."""
    folder = _publish(_model(vlm_dir), vlm_dir, tmp_path)
    assert _tensor_shapes(sorted(folder.glob("*.safetensors"))) == _tensor_shapes([vlm_dir / "model.safetensors"])


def _publish(model, vlm_dir, tmp_path):
    from slipstream.weights.send.folder import publish_weights

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    return publish_weights(model, tokenizer, tmp_path / "run", 1, [5, 6, 7], torch.bfloat16, vlm_dir)


def _tensor_shapes(files) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(file, "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def test_images_need_a_vision_language_trainer_and_whole_images(vlm_dir, rollouts):
    batch = _batch(rollouts)
    model = _model(vlm_dir)
    policy = Policy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="carries images but the trainer's model is a text model"):
        train_step(policy, optimizer, batch, LossConfig(), 1.0, CPU)
    image_inputs = ImageProcessorInputs.from_config(vlm_dir, model.config)
    (mb,) = batch.micro_batches
    first = mb.images[0]
    # A sample given one image too many: its image tokens no longer match its images.
    doubled = msgspec.structs.replace(first, images=first.images * 2)
    bad = msgspec.structs.replace(mb, images=[doubled, *mb.images[1:]])
    with pytest.raises(MicroBatchError, match="has 4 image tokens but its 2 image"):
        image_inputs(bad, CPU)
    no_images = msgspec.structs.replace(mb, images=None)
    with pytest.raises(MicroBatchError, match="image tokens but no images"):
        image_inputs(no_images, CPU)


def test_a_trained_vision_encoder_moves_and_gives_one_fsdp_unit_per_block(vlm_dir, rollouts):
    from types import SimpleNamespace

    from slipstream.config.vlm import VLMConfig
    from slipstream.trainer.setup import setup_vision_encoder

    model = _model(vlm_dir)
    config = SimpleNamespace(model=SimpleNamespace(vlm=VLMConfig(freeze_vision_encoder=False)))
    blocks = setup_vision_encoder(model, config)
    assert blocks == list(model.model.visual.blocks) and len(blocks) == 2
    assert all(p.requires_grad for p in model.parameters())
    policy = Policy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    image_inputs = ImageProcessorInputs.from_config(vlm_dir, model.config)
    train_step(policy, optimizer, _batch(rollouts), LossConfig(), 10.0, CPU, torch.bfloat16, image_inputs=image_inputs)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("model.visual.blocks.") for n in changed)
    text = SimpleNamespace(model=SimpleNamespace(vlm=None))
    assert setup_vision_encoder(model, text) == []
