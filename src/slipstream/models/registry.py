"""Model registry: HF `model_type` -> our args builder, model class and weight adapter; build or load a model as
our own implementation ("custom") or plain transformers ("hf"), and export ours back to an HF state dict."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from slipstream.models.afmoe import hf_adapter as afmoe_adapter
from slipstream.models.afmoe.args import AfmoeArgs
from slipstream.models.afmoe.model import Afmoe
from slipstream.models.glm4_moe import hf_adapter as glm4_moe_adapter
from slipstream.models.glm4_moe.args import Glm4MoeArgs
from slipstream.models.glm4_moe.model import Glm4Moe
from slipstream.models.glm_moe_dsa import hf_adapter as glm_moe_dsa_adapter
from slipstream.models.glm_moe_dsa.args import GlmMoeDsaArgs
from slipstream.models.glm_moe_dsa.model import GlmMoeDsa
from slipstream.models.gpt_oss import hf_adapter as gpt_oss_adapter
from slipstream.models.gpt_oss.args import GptOssArgs
from slipstream.models.gpt_oss.model import GptOss
from slipstream.models.laguna import hf_adapter as laguna_adapter
from slipstream.models.laguna.args import LagunaArgs
from slipstream.models.laguna.model import Laguna
from slipstream.models.llama import hf_adapter as llama_adapter
from slipstream.models.llama.args import LlamaArgs
from slipstream.models.llama.model import Llama
from slipstream.models.minimax_m2 import hf_adapter as minimax_m2_adapter
from slipstream.models.minimax_m2.args import MiniMaxM2Args
from slipstream.models.minimax_m2.model import MiniMaxM2
from slipstream.models.nemotron_h import hf_adapter as nemotron_h_adapter
from slipstream.models.nemotron_h.args import NemotronHArgs
from slipstream.models.nemotron_h.model import NemotronH
from slipstream.models.qwen3 import hf_adapter as qwen3_adapter
from slipstream.models.qwen3.args import Qwen3Args
from slipstream.models.qwen3.model import Qwen3
from slipstream.models.qwen3_5_moe import hf_adapter as qwen3_5_moe_adapter
from slipstream.models.qwen3_5_moe.args import Qwen35MoeArgs
from slipstream.models.qwen3_5_moe.model import Qwen35Moe
from slipstream.models.qwen3_moe import hf_adapter as qwen3_moe_adapter
from slipstream.models.qwen3_moe.args import Qwen3MoeArgs
from slipstream.models.qwen3_moe.model import Qwen3Moe

IMPLS = ("auto", "custom", "hf")
StateDict = dict[str, Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """How to build, load and export one HF model type with our implementation."""

    args_from_hf: Callable[[Any], Any]
    """HF config -> our args dataclass."""
    model_cls: type[nn.Module]
    from_hf: Callable[[StateDict, Any], StateDict]
    """(HF state dict, args) -> our state dict."""
    to_hf: Callable[[StateDict, Any], StateDict]
    """(our state dict, args) -> HF checkpoint state dict."""


MODEL_SPECS: dict[str, ModelSpec] = {
    "llama": ModelSpec(LlamaArgs.from_hf_config, Llama, llama_adapter.from_hf, llama_adapter.to_hf),
    "qwen3": ModelSpec(Qwen3Args.from_hf_config, Qwen3, qwen3_adapter.from_hf, qwen3_adapter.to_hf),
    "qwen3_moe": ModelSpec(Qwen3MoeArgs.from_hf_config, Qwen3Moe, qwen3_moe_adapter.from_hf, qwen3_moe_adapter.to_hf),
    "glm4_moe": ModelSpec(Glm4MoeArgs.from_hf_config, Glm4Moe, glm4_moe_adapter.from_hf, glm4_moe_adapter.to_hf),
    "afmoe": ModelSpec(AfmoeArgs.from_hf_config, Afmoe, afmoe_adapter.from_hf, afmoe_adapter.to_hf),
    "glm_moe_dsa": ModelSpec(
        GlmMoeDsaArgs.from_hf_config, GlmMoeDsa, glm_moe_dsa_adapter.from_hf, glm_moe_dsa_adapter.to_hf
    ),
    "gpt_oss": ModelSpec(GptOssArgs.from_hf_config, GptOss, gpt_oss_adapter.from_hf, gpt_oss_adapter.to_hf),
    "laguna": ModelSpec(LagunaArgs.from_hf_config, Laguna, laguna_adapter.from_hf, laguna_adapter.to_hf),
    "minimax_m2": ModelSpec(
        MiniMaxM2Args.from_hf_config, MiniMaxM2, minimax_m2_adapter.from_hf, minimax_m2_adapter.to_hf
    ),
    # Text-only Qwen3.5-MoE; `qwen3_5_moe` (the checkpoints' type) wraps it with a vision encoder: transformers runs it.
    "qwen3_5_moe_text": ModelSpec(
        Qwen35MoeArgs.from_hf_config, Qwen35Moe, qwen3_5_moe_adapter.from_hf, qwen3_5_moe_adapter.to_hf
    ),
    "nemotron_h": ModelSpec(
        NemotronHArgs.from_hf_config, NemotronH, nemotron_h_adapter.from_hf, nemotron_h_adapter.to_hf
    ),
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(MODEL_SPECS))


def resolve_impl(model_type: str, impl: str) -> str:
    """'custom' or 'hf' for `model_type`: auto picks custom when the type is registered, else transformers."""
    if impl not in IMPLS:
        raise ValueError(f"unknown model impl '{impl}'; choose one of {', '.join(IMPLS)}")
    if impl == "custom" and model_type not in MODEL_SPECS:
        raise ValueError(
            f"impl='custom' does not support model_type '{model_type}' (supported: "
            f"{', '.join(supported_model_types())}); use impl='hf' or impl='auto' to run it with transformers"
        )
    if impl == "auto":
        return "custom" if model_type in MODEL_SPECS else "hf"
    return impl


def build_model(hf_config: Any, impl: str = "auto") -> nn.Module:
    """A freshly initialised model for `hf_config` (a transformers PretrainedConfig) on the current default device
    (use `with torch.device("meta"):` for large models): ours, or transformers' AutoModelForCausalLM."""
    if resolve_impl(hf_config.model_type, impl) == "hf":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(hf_config)
    spec = MODEL_SPECS[hf_config.model_type]
    return spec.model_cls(spec.args_from_hf(hf_config))


def read_safetensors(path: Path) -> StateDict:
    """All tensors of an HF folder (`model.safetensors`, or the shards listed in `model.safetensors.index.json`)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} has no model.safetensors or model.safetensors.index.json")
    state_dict: StateDict = {}
    for name in files:
        state_dict.update(load_file(path / name))
    return state_dict


def load_pretrained(
    path: str | Path, impl: str = "auto", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """Load an HF model folder as our model (weights through the family's adapter) or as a transformers model."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    if resolve_impl(hf_config.model_type, impl) == "hf":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    spec = MODEL_SPECS[hf_config.model_type]
    args = spec.args_from_hf(hf_config)
    state_dict = spec.from_hf({k: v.to(dtype) for k, v in read_safetensors(Path(path)).items()}, args)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.to(device)


def export_hf_state_dict(model: nn.Module) -> StateDict:
    """HF checkpoint state dict of one of our models (detached; may share storage, see the family's adapter)."""
    for spec in MODEL_SPECS.values():
        if isinstance(model, spec.model_cls):  # not `type is`: FSDP2 swaps in a dynamic subclass
            state_dict = {k: v.detach() for k, v in model.state_dict().items()}
            return spec.to_hf(state_dict, model.args)
    raise ValueError(
        f"{type(model).__name__} is not a custom Slipstream model; transformers models export with save_pretrained"
    )
