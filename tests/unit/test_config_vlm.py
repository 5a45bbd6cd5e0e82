"""`[model.vlm]` validators: bfloat16 only (with the reason), a trained vision encoder excludes LoRA, supported
model types only (checked once model.path is known), the trainer through transformers only, TOML round trip."""

import json
import tomllib

import pytest
from pydantic import ValidationError

from slipstream.config import ConfigError, ModelConfig, RLConfig
from slipstream.config.loader import load_config, validate_config
from slipstream.config.vlm import VLM_MODEL_TYPES

BF16_VLM = {"name": "m", "dtype": "bfloat16", "vlm": {}}


def _model_dir(tmp_path, model_type: str):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def test_bfloat16_is_enforced_with_the_reason():
    with pytest.raises(ConfigError) as error:
        validate_config(ModelConfig, {"name": "m", "vlm": {}})
    message = str(error.value)
    assert "model.dtype must be 'bfloat16' with [model.vlm] (got 'float32', the default)" in message
    assert "vision encoder" in message and "bfloat16 bound" in message
    assert message.endswith('Set model.dtype = "bfloat16"')
    with pytest.raises(ConfigError, match=r"\(got 'float32'\): Qwen vision-language checkpoints are bfloat16"):
        validate_config(ModelConfig, {"name": "m", "dtype": "float32", "vlm": {}})
    assert validate_config(ModelConfig, {"name": "m"}).vlm is None  # text models keep float32


def test_trained_vision_encoder_is_rejected_with_lora():
    lora = {"rank": 4}
    with pytest.raises(
        ConfigError, match=r"freeze_vision_encoder = false cannot be combined with \[model.lora\]: LoRA adapts"
    ):
        validate_config(ModelConfig, BF16_VLM | {"vlm": {"freeze_vision_encoder": False}, "lora": lora})
    frozen = validate_config(ModelConfig, BF16_VLM | {"lora": lora})
    assert frozen.vlm.freeze_vision_encoder and frozen.lora.rank == 4
    assert not validate_config(
        ModelConfig, BF16_VLM | {"vlm": {"freeze_vision_encoder": False}}
    ).vlm.freeze_vision_encoder


def test_model_type_is_checked_once_the_path_is_known(tmp_path):
    for model_type in VLM_MODEL_TYPES:
        assert validate_config(ModelConfig, BF16_VLM | {"path": str(_model_dir(tmp_path, model_type))}).vlm
    text_dir = _model_dir(tmp_path, "qwen3")
    with pytest.raises(ConfigError, match=r"model.name 'm' is a 'qwen3' model, not a supported vision-language model"):
        validate_config(ModelConfig, BF16_VLM | {"path": str(text_dir)})
    with pytest.raises(ConfigError, match="cannot read the model type of"):
        validate_config(ModelConfig, BF16_VLM | {"path": str(tmp_path / "missing")})
    # `slipstream rl` sets model.path after parsing: the assignment is checked too
    config = validate_config(ModelConfig, BF16_VLM)
    with pytest.raises(ValidationError, match="remove \\[model.vlm\\] to train a text model"):
        config.path = text_dir
    assert validate_config(ModelConfig, {"name": "m", "path": str(text_dir)}).path == text_dir


def test_tiny_vlm_folder_passes(tmp_path):
    from slipstream.models.tiny_vlm import build_tiny_vlm

    folder = build_tiny_vlm(tmp_path / "vlm")
    assert validate_config(ModelConfig, BF16_VLM | {"path": str(folder)}).path == folder


VLM_RL = (
    'max_steps = 3\noutput_dir = "out"\n[model]\nname = "m"\ndtype = "bfloat16"\n[model.vlm]\n'
    "[orchestrator]\nbatch_size = 4\ngroup_size = 2\n"
)


def test_trainer_takes_vlm_through_transformers_only(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text(VLM_RL)
    assert load_config(RLConfig, ["-c", str(toml)]).trainer.model.vlm is not None
    toml.write_text(VLM_RL + '[trainer]\nmodel_impl = "custom"\n')
    with pytest.raises(ConfigError, match=r"\[model.vlm\] models run through transformers.*model_impl = 'hf'"):
        load_config(RLConfig, ["-c", str(toml)])
    toml.write_text(VLM_RL + "[trainer.parallel]\ncp = 2\n")
    with pytest.raises(ConfigError, match=r"parallel.cp = 2.*set fp8 = false, cp = 1 and ep = 1"):
        load_config(RLConfig, ["-c", str(toml)])


def test_round_trip_through_toml(tmp_path):
    config = validate_config(ModelConfig, BF16_VLM | {"vlm": {"freeze_vision_encoder": False}})
    config.write_toml(tmp_path / "model.toml")
    data = tomllib.loads((tmp_path / "model.toml").read_text())
    assert data["vlm"] == {"freeze_vision_encoder": False}
    assert ModelConfig.model_validate(data) == config


def test_cpu_inference_of_a_vlm_is_refused_with_the_stand_in_named(tmp_path):
    from slipstream.launch.plan import resolve_config

    toml = tmp_path / "rl.toml"
    toml.write_text(VLM_RL)
    config = load_config(RLConfig, ["-c", str(toml)])
    with pytest.raises(ConfigError, match=r"\[model.vlm\] needs vLLM's GPU build.*slipstream_sim.vlm_server"):
        resolve_config(config, gpus=[])
    toml.write_text(
        VLM_RL.replace(
            "[orchestrator]\n",
            "[deployment]\nrun = ['trainer', 'orchestrator']\n[weights]\ntransport = 'filesystem'\n[orchestrator]\n",
        )
    )
    placed = resolve_config(load_config(RLConfig, ["-c", str(toml)]), gpus=[])
    assert placed.inference.device == "auto" and placed.trainer.device == "cpu"


def test_router_replay_is_refused_for_a_vlm_at_config_time(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text(VLM_RL)
    flags = ["--orchestrator.router_replay", "true", "--inference.enable_return_routed_experts", "true"]
    with pytest.raises(ConfigError, match=r"router_replay replays experts in Slipstream's own MoE models"):
        load_config(RLConfig, ["-c", str(toml), *flags])
