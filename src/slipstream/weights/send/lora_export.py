"""The trainer's LoRA adapters as a PEFT adapter folder: `adapter_config.json` + `adapter_model.safetensors` with
PEFT's key names (`base_model.model.<HF module>.lora_A.weight` [R, in], `.lora_B.weight` [out, R]), which `peft`
(PeftModel.from_pretrained) and vLLM's LoRA loader (`--enable-lora`, /v1/load_lora_adapter) read.

Our module names are turned into the Hugging Face checkpoint's through the family's weight adapter (the same plan
as the merged export, weights/send/export.py); stacked experts become one adapter per expert
(`mlp.experts.<e>.gate_proj`), the per-expert layout of HF checkpoints that vLLM's MoE LoRA loads. Under FSDP every
rank gathers the (small) adapters; rank 0 writes.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from slipstream.config.shared import LoRAConfig
from slipstream.models.common.lora import EXPERT_PROJECTIONS, LoRAGroupedExperts, LoRALinear
from slipstream.utils.fs import atomic_write_text

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ADAPTER_DIR = "adapter"
"""Folder of the adapter inside SFT's final model folder (which holds the merged model)."""
MERGED_DIR = "merged"
"""Folder of the merged model inside RL's last published adapter folder."""


@dataclass(frozen=True)
class AdapterTensor:
    """One PEFT tensor: `module.<attr>` (row `index` of its first dim for stacked experts, else all of it)."""

    peft_name: str
    module: nn.Module
    attr: str
    index: int | None


def adapter_plan(model: nn.Module) -> list[AdapterTensor]:
    """The PEFT tensors of `model`'s adapters, in module order (the same on every rank)."""
    from slipstream.weights.send.export import clean_name

    hf_names = _hf_weight_names(model)
    plan = []
    for name, module in model.named_modules():
        name = clean_name(name)
        if isinstance(module, LoRALinear):
            hf_module = _strip_weight(hf_names[f"{name}.weight"][0][0])
            plan += [
                AdapterTensor(f"{PEFT_PREFIX}{hf_module}.lora_{x}.weight", module, f"lora_{x}", None) for x in "AB"
            ]
        elif isinstance(module, LoRAGroupedExperts):
            for proj in EXPERT_PROJECTIONS:
                for hf_name, index in hf_names[f"{name}.{proj}"]:
                    if index is None:
                        raise ValueError(f"{name}.{proj} is not exported one expert per tensor ({hf_name})")
                    hf_module = _strip_weight(hf_name)
                    plan += [
                        AdapterTensor(f"{PEFT_PREFIX}{hf_module}.lora_{x}.weight", module, f"{proj}_lora_{x}", index)
                        for x in "AB"
                    ]
    return plan


def _strip_weight(hf_name: str) -> str:
    if not hf_name.endswith(".weight"):
        raise ValueError(f"an adapted weight is published as {hf_name!r}, not as a module's .weight")
    return hf_name[: -len(".weight")]


def _hf_weight_names(model: nn.Module) -> dict[str, list[tuple[str, int | None]]]:
    """Our (clean) weight name -> its HF checkpoint names, with the expert index for stacked experts."""
    from slipstream.trainer.logprobs import is_custom_model
    from slipstream.weights.send.export import _custom_pieces, _named_tensors

    tensors = _named_tensors(model)
    if not is_custom_model(model):
        return {name: [(name, None)] for name in tensors}
    pieces = _custom_pieces(model, tensors)
    return {name: [(p.hf_name, p.index) for p in ps] for name, ps in pieces.items()}


@torch.no_grad()
def gather_adapter(plan: list[AdapterTensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """PEFT name -> tensor (contiguous, `dtype`, on the CPU); collective under FSDP / EP (every rank calls it)."""
    out: dict[str, Tensor] = {}
    gathered: dict[tuple[int, str], Tensor] = {}
    for t in plan:
        key = (id(t.module), t.attr)
        if key not in gathered:
            tensor = getattr(t.module, t.attr)
            gathered[key] = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()
        full = gathered[key]
        out[t.peft_name] = (full if t.index is None else full[t.index]).to("cpu", dtype).contiguous()
    return out


def peft_config(lora: LoRAConfig, plan: list[AdapterTensor], base_model: str) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields that peft and vLLM read."""
    targets = sorted({t.peft_name.split(".")[-3] for t in plan})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_peft_adapter(
    folder: Path, tensors: dict[str, Tensor], lora: LoRAConfig, plan: list[AdapterTensor], base_model: str
) -> None:
    """Write the adapter's two files into `folder` (created if needed)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    atomic_write_text(folder / ADAPTER_CONFIG, json.dumps(peft_config(lora, plan, base_model), indent=2) + "\n")


def export_peft_adapter(
    model: nn.Module, folder: Path, lora: LoRAConfig, base_model: str, is_main: bool = True
) -> None:
    """Gather `model`'s adapters (all ranks) and write them as a PEFT adapter folder (rank 0), in float32."""
    plan = adapter_plan(model)
    tensors = gather_adapter(plan, torch.float32)
    if is_main:
        write_peft_adapter(folder, tensors, lora, plan, base_model)
