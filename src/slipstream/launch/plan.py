"""Pure planning: an RLConfig becomes the resolved per-process configs and the commands that run them."""

import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.config.rl import RLConfig
from slipstream.launch.colocate_memory import (
    ColocatePlan,
    ModelShape,
    gpu_memory_bytes,
    model_parameters,
    plan_colocated,
)
from slipstream.launch.cpu_cores import CoreSplit, node_split
from slipstream.launch.placement import Placement, PlacementError, detect_visible_gpus, place
from slipstream.rundir import RunDir
from slipstream.utils.fs import commit_dir


@dataclass(frozen=True)
class ProcessSpec:
    """One child process of a run."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the launcher's environment."""
    must_run_to_end: bool = True
    """True if the run fails when this process exits (inference); False if exit 0 means it finished its work."""
    cpus: tuple[int, ...] = ()
    """CPU cores it and everything it starts may run on (launch/cpu_cores.py); empty: the launcher's."""


def config_paths(config: RLConfig) -> dict[str, Path]:
    run = RunDir(config.output_dir)
    return {name: run.config_path(name) for name in ("rl", "inference", "orchestrator", "trainer")}


def write_configs(config: RLConfig) -> dict[str, Path]:
    """Write the resolved config of the run and of each process into `output_dir/config/`, all or nothing: they
    are written into a temporary folder renamed into place, so a failed write leaves the previous ones (or none)."""
    paths = config_paths(config)
    folder = paths["rl"].parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".config."))
    try:
        tmp.chmod(0o755)
        for name, section in (
            ("rl", config),
            *((n, getattr(config, n)) for n in ("inference", "orchestrator", "trainer")),
        ):
            section.write_toml(tmp / paths[name].name)
        commit_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return paths


def build_plan(
    config: RLConfig,
    python: str = sys.executable,
    gpus: Sequence[int] | None = None,
    cores: Sequence[int] | None = None,
) -> list[ProcessSpec]:
    """Processes of this node (deployment.run) in start order: inference, trainer (loads its model while vLLM starts),
    orchestrator; each pinned to its GPUs, or on a CPU node to its cores (core_split). `gpus`: the GPUs this node
    shows, `cores` the CPU cores the launcher may use (None: detect them)."""
    placement = place_config(config, gpus)
    paths, run = config_paths(config), RunDir(config.output_dir)
    cli = [python, "-m", "slipstream"]
    torchrun = torchrun_argv(python, rendezvous_args(config), placement.num_trainer_procs)
    env = {"PYTHONUNBUFFERED": "1"}
    split = core_split(config, placement, cores)
    argv = {
        "inference": [*cli, "inference", "-c", str(paths["inference"])],
        "trainer": [*torchrun, "trainer", "-c", str(paths["trainer"])],
        "orchestrator": [*cli, "orchestrator", "-c", str(paths["orchestrator"])],
    }
    return [
        ProcessSpec(
            role,
            argv[role],
            run.log_path(trainer_log_name(config) if role == "trainer" else role),
            {**env, **placement.env(role), **(split.env(role) if split else {})},
            must_run_to_end=role == "inference",
            cpus=split.cpus(role) if split else (),
        )
        for role in ("inference", "trainer", "orchestrator")
        if role in placement.run
    ]


def core_split(config: RLConfig, placement: Placement, cores: Sequence[int] | None = None) -> CoreSplit | None:
    """deployment.split_cpu_cores on a CPU node running vLLM and the trainer side by side (launch/cpu_cores.py);
    `cores`: the launcher's (None: its CPU affinity)."""
    side_by_side = {"inference", "trainer"} <= set(placement.run) and not placement.colocated
    on_gpus = bool(placement.inference_gpus or placement.trainer_gpus)
    if not config.deployment.split_cpu_cores or on_gpus or not side_by_side:
        return None
    per_rank = config.trainer.num_threads
    threads = None if per_rank is None else per_rank * placement.num_trainer_procs
    ranks = placement.tensor_parallel_size * placement.data_parallel_size
    return node_split(threads, config.inference.cpu_threads_bind, cores, ranks)


def torchrun_argv(python: str, rendezvous: list[str], num_procs: int) -> list[str]:
    """`python -m torch.distributed.run <rendezvous> --nproc-per-node N -m slipstream`: a Slipstream command (to
    append) started as N ranks of this node."""
    return [python, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(num_procs), "-m", "slipstream"]


def rendezvous_args(config: RLConfig) -> list[str]:
    """torchrun's rendezvous: standalone on one node; with launch.trainer_nodes > 1, this node's rank and trainer
    node 0's address (a static rendezvous: every node knows its rank)."""
    launch = config.launch
    if launch.trainer_nodes == 1:
        return ["--standalone"]
    return [
        "--nnodes", str(launch.trainer_nodes),
        "--node-rank", str(launch.trainer_node_rank),
        "--master-addr", launch.trainer_master_addr,
        "--master-port", str(launch.trainer_master_port),
    ]  # fmt: skip


def trainer_log_name(config: RLConfig) -> str:
    """`trainer` (logs/trainer.log) on trainer node 0, `trainer_node<r>` on the others (they share the run
    directory)."""
    rank = config.launch.trainer_node_rank
    return "trainer" if rank == 0 else f"trainer_node{rank}"


def resolve_config(config: RLConfig, gpus: Sequence[int] | None = None) -> RLConfig:
    """The config this node runs, to call before write_configs: the deployment placed on this node's GPUs (`gpus`;
    None: detect them) and what depends on it filled in: launch.num_trainer_procs, inference.data_parallel_size,
    inference.device / trainer.device, weights.transport ("auto"), model.dtype (bfloat16 on GPUs when unset),
    inference.enforce_eager (false on GPUs, true on CPU, when unset). Raises ConfigError (PlacementError) naming
    what to change."""
    return resolve_with_memory(config, gpus)[0]


def resolve_with_memory(config: RLConfig, gpus: Sequence[int] | None = None) -> tuple[RLConfig, ColocatePlan | None]:
    """resolve_config, and the memory plan it applied when the run is colocated on GPUs (None otherwise)."""
    placement = place_config(config, gpus)
    changes = placement_changes(config, placement)
    memory = colocated_memory(config, placement)
    if memory is not None:
        changes["inference"]["gpu_memory_utilization"] = memory.utilization
    return config.rebuilt(changes), memory


def colocated_memory(config: RLConfig, placement: Placement) -> ColocatePlan | None:
    """The memory plan of a run colocated on GPUs (launch/colocate_memory.py); None otherwise. PlacementError when
    the model cannot fit, or when the GPUs' memory cannot be read and inference.gpu_memory_utilization is unset."""
    if not placement.colocated or not placement.inference_gpus:
        return None
    gpu_bytes = gpu_memory_bytes(placement.inference_gpus)
    if gpu_bytes is None:
        if config.inference.gpu_memory_utilization is None:
            raise PlacementError(
                f"a colocated run sizes vLLM's share of GPU(s) {list(placement.inference_gpus)} from their memory, "
                "which nvidia-smi did not report; set inference.gpu_memory_utilization (vLLM's share, e.g. 0.5)"
            )
        return None
    model = Path(str(config.model.path or config.model.name))
    shape = ModelShape.read(model)
    return plan_colocated(config, model_parameters(model), shape, gpu_bytes, len(placement.inference_gpus))


def place_config(config: RLConfig, gpus: Sequence[int] | None = None) -> Placement:
    """Placement of `config` on the GPUs this node shows (`gpus`; None: detect them)."""
    visible = detect_visible_gpus() if gpus is None else list(gpus)
    return place(config, visible, model_attention_heads(str(config.model.path or config.model.name)))


def placement_changes(config: RLConfig, placement: Placement) -> dict[str, Any]:
    """Config values that follow from `placement` (a nested dict for RLConfig.rebuilt)."""
    changes: dict[str, Any] = {
        "launch": {"num_trainer_procs": placement.num_trainer_procs},
        "inference": {"data_parallel_size": placement.data_parallel_size},
        "trainer": {},
        "weights": {"transport": placement.weights_transport},
    }
    for role, ids in (("inference", placement.inference_gpus), ("trainer", placement.trainer_gpus)):
        if role in placement.run:
            changes[role]["device"] = _device(role, getattr(config, role).device, bool(ids))
    if "inference" in placement.run:  # CUDA graphs on GPUs, eager on CPU, unless set
        changes["inference"]["enforce_eager"] = config.inference.eager_on(bool(placement.inference_gpus))
    if placement.colocated:  # the orchestrator hands the GPU over; vLLM sleeps where it can
        level = config.deployment.sleep_level
        changes["orchestrator"] = {"colocate": {"sleep_level": level}}
        changes["trainer"]["colocated"] = True
        changes["trainer"]["release_cached_memory"] = bool(placement.trainer_gpus) and level >= 1
        changes["inference"]["enable_sleep_mode"] = bool(placement.inference_gpus) and level >= 1
    if (placement.inference_gpus or placement.trainer_gpus) and "dtype" not in config.model.model_fields_set:
        changes["model"] = {"dtype": "bfloat16"}
    return changes


def _device(role: str, asked: str, on_gpu: bool) -> str:
    placed = "cuda" if on_gpu else "cpu"
    if asked not in ("auto", placed):
        where = "gets GPUs" if on_gpu else "gets no GPU"
        raise PlacementError(
            f"{role}.device = {asked!r}, but the {role} {where} on this node; leave {role}.device unset, or change "
            f"deployment.gpus / deployment.{role}_gpus"
        )
    return placed


def model_attention_heads(name: str) -> int | None:
    """num_attention_heads from the model's config.json when it is on this machine already (a model folder, an
    imported alias, a hub id in the Hugging Face cache); None otherwise (vLLM then checks it when it starts)."""
    path = _local_config_json(name)
    if path is None:
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable here: vLLM reports it, naming the file
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    heads = cfg.get("num_attention_heads", text.get("num_attention_heads"))
    return heads if isinstance(heads, int) and heads > 0 else None


def _local_config_json(name: str) -> Path | None:
    from slipstream.models.cache import default_cache_dir

    for folder in (Path(name).expanduser(), default_cache_dir() / "models" / name):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except (ImportError, ValueError):  # no huggingface_hub, or not a hub id
        return None
    return Path(found) if isinstance(found, str) else None
