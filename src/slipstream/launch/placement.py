"""GPU placement on one node: an RLConfig and the GPUs this node shows become each process's CUDA_VISIBLE_DEVICES
and the sizes vLLM (tensor x data parallel) and torchrun (ranks) start with, or a PlacementError naming what to change.

Pure apart from detect_visible_gpus(), which the launcher calls once: tests pass the GPU list. GPU ids are the
launcher's own (its CUDA_VISIBLE_DEVICES entries, else nvidia-smi's indices), so a child's CUDA_VISIBLE_DEVICES is a
subset of the launcher's and still means the same physical GPUs.
"""

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slipstream.config.base import ConfigError
from slipstream.config.deployment import DeploymentConfig
from slipstream.config.inference import InferenceConfig
from slipstream.config.rl import RLConfig

GPU_ROLES = ("inference", "trainer")


class PlacementError(ConfigError):
    """An impossible GPU split on this node; the message names the fields to change."""


@dataclass(frozen=True)
class Placement:
    """Where this node's processes run and with which parallel sizes."""

    run: tuple[str, ...]
    """Processes started on this node (deployment.run)."""
    inference_gpus: tuple[int, ...]
    """GPU ids of vLLM (empty: CPU, or inference runs elsewhere)."""
    trainer_gpus: tuple[int, ...]
    """GPU ids of the trainer's ranks, one each (empty: CPU, or the trainer runs elsewhere)."""
    gpu_node: bool
    """This node shows GPUs: every child gets its own CUDA_VISIBLE_DEVICES (empty for the orchestrator)."""
    tensor_parallel_size: int
    data_parallel_size: int
    num_trainer_procs: int
    weights_transport: str
    """weights.transport with "auto" resolved."""
    colocated: bool = False
    """deployment.colocate resolved: vLLM and the trainer share this node's one usable GPU (or, on CPU, take
    turns all the same)."""

    def env(self, role: str) -> dict[str, str]:
        """Variables that pin `role` to its GPUs ({} where the node has none: the environment stays as it was)."""
        if not self.gpu_node:
            return {}
        ids = {"inference": self.inference_gpus, "trainer": self.trainer_gpus}.get(role, ())
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids)}


def detect_visible_gpus(environ: Mapping[str, str] | None = None) -> list[int]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else nvidia-smi's indices, else none."""
    env = os.environ if environ is None else environ
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        return parse_visible_devices(raw)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True)
    if out.returncode != 0:
        raise PlacementError(
            f"nvidia-smi failed ({out.stderr.strip() or out.returncode}), so the GPUs of this node are unknown; "
            "set CUDA_VISIBLE_DEVICES (empty: CPU) or fix the driver"
        )
    return [int(line) for line in out.stdout.split()]


def parse_visible_devices(raw: str) -> list[int]:
    """CUDA_VISIBLE_DEVICES as ids; like CUDA, the list ends at the first negative entry."""
    ids: list[int] = []
    for entry in (e.strip() for e in raw.split(",") if e.strip()):
        try:
            value = int(entry)
        except ValueError:
            raise PlacementError(
                f"CUDA_VISIBLE_DEVICES holds {entry!r}; slipstream rl places processes by GPU index: list indices "
                "(e.g. 0,1,2,3)"
            ) from None
        if value < 0:
            break
        ids.append(value)
    return ids


def place(config: RLConfig, visible: Sequence[int], num_attention_heads: int | None = None) -> Placement:
    """Split this node's GPUs between the processes of config.deployment.run and check the parallel sizes.
    `num_attention_heads` (from the model's config.json, when known) is checked against tensor parallelism."""
    deployment = config.deployment
    gpus = usable_gpus(deployment, visible)
    colocated = resolve_colocate(deployment, gpus)
    if colocated and len(gpus) > 1:
        raise PlacementError(
            f"deployment.colocate shares one GPU between vLLM and the trainer, but {len(gpus)} are usable ({gpus}): "
            "weights reach vLLM through CUDA IPC from the trainer's first rank, which a second GPU's workers cannot "
            "map; choose one with deployment.gpus = [i], or run them side by side (deployment.colocate = false)"
        )
    inference_gpus, trainer_gpus = (list(gpus), list(gpus)) if colocated else split_gpus(deployment, gpus)
    here = set(deployment.run)
    if inference_gpus and "inference" in here and config.model.lora is not None and config.model.dtype == "float32":
        raise PlacementError(
            "model.lora with model.dtype = 'float32' cannot run on vLLM's GPUs: its LoRA kernels take float16 and "
            "bfloat16 only (vLLM asserts it at start); set model.dtype = 'bfloat16', or fine-tune the whole model "
            "(drop [model.lora])"
        )
    tp, dp = inference_sizes(config.inference, inference_gpus, num_attention_heads if "inference" in here else None)
    procs = trainer_procs(config, trainer_gpus)
    return Placement(
        run=tuple(deployment.run),
        inference_gpus=tuple(inference_gpus),
        trainer_gpus=tuple(trainer_gpus),
        gpu_node=bool(visible),
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        num_trainer_procs=procs,
        weights_transport=resolve_transport(config, inference_gpus, trainer_gpus, colocated),
        colocated=colocated,
    )


def resolve_colocate(deployment: DeploymentConfig, gpus: list[int]) -> bool:
    """deployment.colocate with None resolved: colocated when inference, trainer and orchestrator all run here on
    exactly one usable GPU and no split was asked for (DeploymentConfig checks an explicit true)."""
    if deployment.colocate is not None:
        return deployment.colocate
    return (
        len(gpus) == 1
        and all(role in deployment.run for role in ("inference", "trainer", "orchestrator"))
        and deployment.inference_gpus is None
        and deployment.trainer_gpus is None
    )


def usable_gpus(deployment: DeploymentConfig, visible: Sequence[int]) -> list[int]:
    """deployment.gpus checked against the visible GPUs, or all of them when unset."""
    if deployment.gpus is None:
        return list(visible)
    if missing := [i for i in deployment.gpus if i not in visible]:
        raise PlacementError(
            f"deployment.gpus lists GPU(s) {missing}, but this node shows {_shown(visible)}; fix deployment.gpus"
        )
    return list(deployment.gpus)


def split_gpus(deployment: DeploymentConfig, gpus: list[int]) -> tuple[list[int], list[int]]:
    """(inference ids, trainer ids): explicit lists first, then counts (inference from the front of the free GPUs,
    the trainer from the back), then the defaults."""
    roles = [role for role in GPU_ROLES if role in deployment.run]
    shares = {role: getattr(deployment, f"{role}_gpus") for role in roles}
    if not gpus:
        if asked := [role for role in roles if shares[role] is not None]:
            raise PlacementError(
                f"deployment.{asked[0]}_gpus asks for GPUs, but this node shows none; drop it to run on CPU"
            )
        return [], []
    chosen: dict[str, list[int]] = {}
    for role in roles:
        if isinstance(shares[role], list):
            if missing := [i for i in shares[role] if i not in gpus]:
                raise PlacementError(
                    f"deployment.{role}_gpus lists GPU(s) {missing} that are not available (usable: {gpus}, from "
                    "deployment.gpus or the visible GPUs); fix the ids"
                )
            chosen[role] = list(shares[role])
    free = [i for i in gpus if not any(i in ids for ids in chosen.values())]
    for role in roles:
        if isinstance(shares[role], int):
            if shares[role] > len(free):
                raise PlacementError(
                    f"deployment.{role}_gpus asks for {shares[role]} GPUs, but only {len(free)} of {gpus} are free; "
                    f"lower it (or deployment.{_other(role)}_gpus)"
                )
            if role == "inference":
                chosen[role], free = free[: shares[role]], free[shares[role] :]
            else:
                keep = len(free) - shares[role]
                chosen[role], free = free[keep:], free[:keep]
    _default_split(roles, chosen, free)
    return chosen.get("inference", []), chosen.get("trainer", [])


def _default_split(roles: list[str], chosen: dict[str, list[int]], free: list[int]) -> None:
    """Give the roles without a share theirs: both -> half each (inference n // 2), one -> every free GPU."""
    missing = [role for role in roles if role not in chosen]
    if len(missing) == 2:
        if len(free) < 2:
            raise PlacementError(
                f"inference and the trainer each need their own GPU, but {len(free)} is usable ({free}); share it "
                "(deployment.colocate = true), use more GPUs, run one of them on another node (deployment.run), or "
                "run on CPU (deployment.gpus = [])"
            )
        half = len(free) // 2
        chosen["inference"], chosen["trainer"] = free[:half], free[half:]
    elif missing:
        if not free:
            raise PlacementError(
                f"no GPU is left for the {missing[0]}: deployment.{_other(missing[0])}_gpus takes them all; "
                f"lower it or set deployment.{missing[0]}_gpus"
            )
        chosen[missing[0]] = free


def inference_sizes(inference: InferenceConfig, gpus: list[int], num_attention_heads: int | None) -> tuple[int, int]:
    """(tensor_parallel_size, data_parallel_size) of vLLM: tp x dp must cover inference's GPUs exactly."""
    tp, dp = inference.tensor_parallel_size, inference.data_parallel_size
    if num_attention_heads is not None and num_attention_heads % tp != 0:
        raise PlacementError(
            f"inference.tensor_parallel_size ({tp}) must divide the model's {num_attention_heads} attention heads; "
            "change it (and inference.data_parallel_size)"
        )
    if not gpus:
        return tp, dp or 1
    n, engines = len(gpus), _engines_here(inference)
    if n % engines != 0:
        raise PlacementError(
            f"the {engines} vLLM engines of this node (inference.deployment) must share the {n} GPUs inference gets "
            f"({gpus}) evenly; change deployment.inference_gpus or inference.deployment"
        )
    n //= engines
    if dp is None:
        if n % tp != 0:
            raise PlacementError(
                f"inference.tensor_parallel_size ({tp}) must divide the {n} GPUs inference gets ({gpus}); change it "
                "or deployment.inference_gpus"
            )
        dp = n // tp
    if tp * dp != n:
        raise PlacementError(
            f"inference.tensor_parallel_size ({tp}) x inference.data_parallel_size ({dp}) = {tp * dp} must equal "
            f"the {n} GPUs {'inference gets' if engines == 1 else 'each engine gets'} ({gpus}); change them or "
            "deployment.inference_gpus"
        )
    return tp, dp


def _engines_here(inference: InferenceConfig) -> int:
    """vLLM engines on this node (inference.deployment), each on tensor x data parallel GPUs."""
    rank = inference.deployment.node_rank
    return max(1, sum(1 for engine in inference.engines if engine.node_rank == rank))


def trainer_procs(config: RLConfig, gpus: list[int]) -> int:
    """torchrun ranks on this node: one per trainer GPU; launch.num_trainer_procs (or 1) on CPU or elsewhere."""
    procs = config.launch.num_trainer_procs
    if not gpus:
        return procs or 1
    if procs is not None and procs != len(gpus):
        raise PlacementError(
            f"launch.num_trainer_procs ({procs}) must equal the trainer's {len(gpus)} GPUs ({gpus}), one rank per "
            f"GPU; set deployment.trainer_gpus = {procs}, or leave launch.num_trainer_procs unset"
        )
    return len(gpus)


def resolve_transport(
    config: RLConfig, inference_gpus: list[int], trainer_gpus: list[int], colocated: bool = False
) -> str:
    """weights.transport with "auto" resolved: colocated on GPUs ipc (NCCL cannot join two processes of one GPU),
    else nccl when the trainer gets GPUs, else filesystem. nccl needs the GPU processes of this node on GPUs and
    apart."""
    transport, run = config.weights.transport, config.deployment.run
    if transport == "auto":
        if colocated and trainer_gpus:
            return "ipc"
        return "nccl" if trainer_gpus else "filesystem"
    if transport == "nccl" and colocated and trainer_gpus:
        raise PlacementError(
            "weights.transport = 'nccl' cannot join vLLM and the trainer on the same GPU (deployment.colocate): "
            "use 'ipc' (or 'auto'), or give them separate GPUs (deployment.colocate = false)"
        )
    if transport == "nccl":
        for role, ids in (("trainer", trainer_gpus), ("inference", inference_gpus)):
            if role in run and not ids:
                raise PlacementError(
                    f"weights.transport = 'nccl' needs GPUs, but the {role} runs on CPU here; use 'gloo' or "
                    "'filesystem' (or 'auto'), or give it GPUs"
                )
    return transport


def _other(role: str) -> str:
    return "trainer" if role == "inference" else "inference"


def _shown(visible: Sequence[int]) -> str:
    return f"GPUs {list(visible)}" if visible else "no GPU"
