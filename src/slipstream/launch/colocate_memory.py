"""Memory plan of a colocated run (deployment.colocate on GPUs): how much of each GPU vLLM may take so that the
trainer's resident state fits beside it, or a PlacementError naming the knob when the model cannot fit.

While vLLM generates, the trainer keeps its resident state on the GPU: the float32 master weights, their gradients
and AdamW's two moments (16 bytes per parameter; 12 with trainer.optim.state_dtype = "bfloat16"; the bf16 weights
of the blocks in use with trainer.optim.cpu_offload), sharded over the trainer's ranks, plus the ipc transport's buffer
(the bf16 model, once, on rank 0). vLLM gets the rest (minus a reserve for CUDA contexts and allocator slack). While
the trainer steps, vLLM sleeps (deployment.sleep_level 1 or 2), so the trainer's activations may use vLLM's share;
at level 0 vLLM keeps it and the activations must fit beside it too.

Pure apart from gpu_memory_bytes() (nvidia-smi) and model_parameters() (the checkpoint's safetensors headers).
"""

import json
import shutil
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from math import floor, prod
from pathlib import Path

from slipstream.config.rl import RLConfig
from slipstream.launch.placement import PlacementError

GIB = 2**30
RESERVE_BYTES = 3 * GIB
"""Per GPU, outside both budgets: two CUDA contexts, NCCL/cuBLAS workspaces, allocator fragmentation."""
MIN_KV_BYTES = 1 * GIB
"""The least KV cache worth starting vLLM with (a few thousand tokens of a small model)."""
BF16 = 2
MAX_UTILIZATION = 0.9
"""vLLM's share is never planned above its default (a small model would otherwise leave the trainer's start-up, its
probe forward and the weight buckets no slack)."""


@dataclass(frozen=True)
class ColocatePlan:
    """One GPU's budget in a colocated run (bytes)."""

    gpu_bytes: int
    trainer_bytes: int
    """The trainer's resident state on the GPU that holds most of it (rank 0: its shard and the ipc buffer)."""
    activation_bytes: int
    """Budgeted beside vLLM for the trainer's activations (sleep level 0 only; 0 otherwise)."""
    vllm_min_bytes: int
    """vLLM's weights (its tensor-parallel share) and the least KV cache."""
    utilization: float
    """vLLM's gpu_memory_utilization: what is left of the GPU."""

    def summary(self) -> str:
        gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
        extra = f" + {gib(self.activation_bytes)} of activations (sleep_level 0)" if self.activation_bytes else ""
        return (
            f"colocated memory plan per GPU of {gib(self.gpu_bytes)}: trainer resident {gib(self.trainer_bytes)}{extra}, "
            f"reserve {gib(RESERVE_BYTES)}, vLLM gpu_memory_utilization {self.utilization:.2f} "
            f"({gib(int(self.utilization * self.gpu_bytes))}, of which weights and the least KV cache {gib(self.vllm_min_bytes)})"
        )


def trainer_bytes_per_parameter(config: RLConfig) -> float:
    """Resident trainer bytes per parameter (before sharding): masters, gradients, AdamW moments."""
    trainer = config.trainer
    if trainer.optim.cpu_offload:
        return BF16  # only the bf16 copy of the blocks in use stays (an upper bound: all of them)
    return 4 + 4 + (4 if trainer.optim.state_dtype == "bfloat16" else 8)


def plan_colocated(
    config: RLConfig, num_params: int, shape: "ModelShape", gpu_bytes: int, num_gpus: int
) -> ColocatePlan:
    """The budget of one of `num_gpus` GPUs of `gpu_bytes` each shared by vLLM and a trainer of `num_params`
    parameters; PlacementError when the model cannot fit or (explicit) gpu_memory_utilization leaves the trainer too
    little."""
    ranks = max(1, num_gpus)
    trainer = int(num_params * trainer_bytes_per_parameter(config) / ranks)
    if config.weights.transport in ("ipc", "auto"):
        trainer += num_params * BF16  # the shared buffer lives on rank 0's GPU
    activations = 0
    if config.deployment.sleep_level == 0:
        activations = activation_bytes(config, shape)
    tp = config.inference.tensor_parallel_size
    vllm_min = int(num_params * BF16 / tp) + MIN_KV_BYTES
    free_for_vllm = gpu_bytes - trainer - activations - RESERVE_BYTES
    asked = config.inference.gpu_memory_utilization
    if free_for_vllm < vllm_min:
        need = (trainer + activations + RESERVE_BYTES + vllm_min) / GIB
        raise PlacementError(
            f"the model ({num_params / 1e9:.2f}B parameters) does not fit colocated on a {gpu_bytes / GIB:.0f} GiB GPU: "
            f"the trainer keeps {trainer / GIB:.1f} GiB resident and vLLM needs at least {vllm_min / GIB:.1f} GiB "
            f"(about {need:.0f} GiB in all); set trainer.optim.state_dtype = 'bfloat16' or trainer.optim.cpu_offload = true "
            "(several GPUs), colocate on more GPUs (deployment.gpus), or give vLLM and the trainer separate GPUs "
            "(deployment.colocate = false)"
            + (
                f"; at sleep_level 0 the trainer's activations ({activations / GIB:.1f} GiB for "
                f"micro_batch_tokens = {config.orchestrator.micro_batch_tokens}) need room beside vLLM too: use "
                "deployment.sleep_level = 1 or fewer micro_batch_tokens"
                if activations
                else ""
            )
        )
    utilization = min(MAX_UTILIZATION, floor(free_for_vllm / gpu_bytes * 100) / 100) if asked is None else asked
    if asked is not None and asked * gpu_bytes > free_for_vllm:
        raise PlacementError(
            f"inference.gpu_memory_utilization = {asked} gives vLLM {asked * gpu_bytes / GIB:.1f} GiB of the "
            f"{gpu_bytes / GIB:.0f} GiB GPU it shares with the trainer, which keeps {trainer / GIB:.1f} GiB resident"
            f"{' plus activations' if activations else ''}; lower it to at most {free_for_vllm / gpu_bytes:.2f} (or "
            "leave it unset: slipstream rl plans it)"
        )
    return ColocatePlan(gpu_bytes, trainer, activations, vllm_min, utilization)


def activation_bytes(config: RLConfig, shape: "ModelShape") -> int:
    """The trainer's activations at their peak for one micro-batch of orchestrator.micro_batch_tokens, budgeted beside
    an awake vLLM (sleep level 0). An upper bound fitted on H200 runs (the Qwen3-0.6B shape: 82 GiB allocated at 16k
    tokens, where this gives 89): 32 bytes per logit (bf16 logits, their float32 log-softmax, gradients) and 34 bytes
    per hidden unit per layer (saved activations; 4 with activation checkpointing), at least 2 GiB."""
    tokens = config.orchestrator.micro_batch_tokens
    per_layer = 4 if config.trainer.parallel.activation_checkpointing else 34
    return max(2 * GIB, tokens * (shape.vocab_size * 32 + shape.num_layers * shape.hidden_size * per_layer))


@dataclass(frozen=True)
class ModelShape:
    """What the activation budget needs of a model's config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int

    @classmethod
    def read(cls, model_dir: Path) -> "ModelShape":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        try:
            return cls(int(text["vocab_size"]), int(text["hidden_size"]), int(text["num_hidden_layers"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{model_dir}/config.json lacks {e} (vocab_size, hidden_size, num_hidden_layers)") from e


def oom_hint(config: RLConfig, role: str) -> str:
    """What to change when `role` ran out of GPU memory, with the values this run used."""
    colocated = config.trainer.colocated
    share = config.inference.gpu_memory_utilization
    if role == "trainer":
        hint = (
            f"the trainer ran out of GPU memory: lower orchestrator.micro_batch_tokens (now "
            f"{config.orchestrator.micro_batch_tokens}), or turn on trainer.parallel.activation_checkpointing, "
            "trainer.optim.state_dtype = 'bfloat16' or trainer.optim.cpu_offload (several GPUs)"
        )
        if colocated and config.deployment.sleep_level == 0:
            hint += "; colocated at sleep_level 0, vLLM keeps its memory: deployment.sleep_level = 1 frees it"
        elif colocated:
            hint += f"; colocated: a lower inference.gpu_memory_utilization (now {share}) leaves the trainer more"
        return hint
    hint = (
        f"vLLM ran out of GPU memory: lower inference.gpu_memory_utilization (now {share if share is not None else 0.9}), "
        f"inference.max_num_seqs ({config.inference.max_num_seqs}) or inference.max_model_len "
        f"({config.inference.max_model_len})"
    )
    if colocated:
        hint += "; colocated, the trainer holds the rest of the GPU (the memory plan printed at the start)"
    return hint


def model_parameters(model_dir: Path) -> int:
    """Parameters of a checkpoint folder, from its safetensors headers (no tensor is read)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors file to size the model from")
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def gpu_memory_bytes(gpu_ids: Sequence[int]) -> int | None:
    """The smallest total memory of these GPUs (nvidia-smi indices), or None where nvidia-smi cannot tell."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = subprocess.run(
        [smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    if out.returncode != 0:
        return None
    sizes = {}
    for line in out.stdout.splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            sizes[int(index)] = int(mib) * 2**20
    known = [sizes[i] for i in gpu_ids if i in sizes]
    return min(known) if len(known) == len(gpu_ids) and known else None
