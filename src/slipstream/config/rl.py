"""Config of `slipstream rl`: the three processes plus the fields they share, set once at the top level."""

from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from pydantic import BaseModel, Field, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.deployment import DeploymentConfig
from slipstream.config.inference import InferenceConfig
from slipstream.config.inference_deployment import InferenceDeploymentConfig, engine_slots, uses_router
from slipstream.config.kubernetes import KubernetesConfig
from slipstream.config.monitor import MonitorConfig
from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.config.shared import CheckpointConfig, ModelConfig
from slipstream.config.slurm import SlurmConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.config.weights import WeightsConfig

# shared top-level key -> sections that receive it
_SHARED = {
    "model": ("inference", "orchestrator", "trainer"),
    "output_dir": ("orchestrator", "trainer"),
    "max_steps": ("orchestrator", "trainer"),
    "seed": ("inference", "orchestrator", "trainer"),
    "checkpoint": ("orchestrator", "trainer"),
    "weights": ("inference", "orchestrator", "trainer"),
    "monitor": ("orchestrator", "trainer"),
}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
RL_CHECKPOINT_INTERVAL = 50
"""checkpoint.interval of `slipstream rl` when unset: `--resume` after a crash loses at most this many steps."""

# options that `slipstream rl --help` leaves out: set at the top level instead
HELP_SKIP = tuple(f"--{section}.{key}" for key, sections in _SHARED.items() for section in sections) + (
    "--orchestrator.num_trainer_ranks",
    "--orchestrator.resume_step",
    "--trainer.resume_step",
    "--trainer.whole_run_checkpoints",
    "--model.path",  # set by the launcher (the resolved model folder)
)


class LaunchConfig(BaseConfig):
    """How `slipstream rl` starts and supervises the processes on this machine."""

    num_trainer_procs: int | None = Field(None, ge=1)
    """Trainer ranks started by torchrun on this node. On GPUs it must equal the trainer's GPUs
    (deployment.trainer_gpus); None: that count, or 1 on CPU. Where the orchestrator runs without the trainer
    (deployment.run), set it to the trainer node's rank count."""

    health_timeout_s: float = Field(600.0, gt=0.0)
    """How long to wait for the inference server's /health before giving up."""

    shutdown_grace_s: float = Field(10.0, gt=0.0)
    """Seconds between SIGTERM and SIGKILL when stopping the processes."""

    inference_restarts: int = Field(3, ge=0)
    """How many times the inference server is restarted when it dies mid-run (crash, OOM kill) before the run
    stops; the orchestrator waits for it and reloads the served weights (orchestrator.recovery). 0: an inference
    death stops the run. A trainer or orchestrator death always stops the run."""

    inference_restart_backoff_s: float = Field(2.0, ge=0.0)
    """Delay before restarting a dead inference server, doubled for each further restart (at most 60 s)."""

    trainer_nodes: int = Field(1, ge=1)
    """Nodes the trainer spans (torchrun --nnodes), each with launch.num_trainer_procs ranks. With more than one,
    every trainer node runs `slipstream rl` with its own launch.trainer_node_rank and the same
    SLIPSTREAM_LAUNCH_ID in its environment (a Slurm job sets both): node 0 owns the run (its lock, resume, the
    per-process configs, and the orchestrator where it runs there); the others run only "trainer" and start their
    ranks once node 0 has written the configs of this launch."""

    trainer_node_rank: int = Field(0, ge=0)
    """This node's rank among the trainer's nodes (torchrun --node-rank), below launch.trainer_nodes."""

    trainer_master_addr: str = "127.0.0.1"
    """Address of trainer node 0, reachable from the other trainer nodes: torchrun's rendezvous (--master-addr)."""

    trainer_master_port: int = Field(29400, ge=1, le=65535)
    """Port of torchrun's rendezvous on trainer node 0 (--master-port), with launch.trainer_nodes > 1."""

    @model_validator(mode="after")
    def _check_trainer_nodes(self) -> "LaunchConfig":
        if self.trainer_node_rank >= self.trainer_nodes:
            raise ValueError(
                f"launch.trainer_node_rank ({self.trainer_node_rank}) must be below launch.trainer_nodes "
                f"({self.trainer_nodes})"
            )
        return self


class RLConfig(BaseConfig):
    """Asynchronous RL: inference + orchestrator + trainer. `model`, `output_dir`, `max_steps` and `seed`
    are set here once and copied into every section that uses them."""

    shared_keys: ClassVar[dict[str, tuple[str, ...]]] = _SHARED

    model: ModelConfig
    """Model to train and serve."""

    output_dir: Path = Path("outputs/run")
    """Run directory: config/, logs/, rollouts/, weights/, checkpoints/, metrics.jsonl."""

    max_steps: int = Field(ge=1)
    """Number of training steps."""

    seed: int = 0
    """Seed shared by all processes."""

    weights: WeightsConfig = WeightsConfig()
    """Weight transfer from trainer to inference after every step. `transport = "auto"` becomes nccl when the
    trainer gets GPUs, else filesystem (decided at launch)."""

    checkpoint: CheckpointConfig = CheckpointConfig(interval=RL_CHECKPOINT_INTERVAL)
    """Whole-run checkpoints (trainer and orchestrator state of a step, committed together) and their retention. On
    by default: every 50 steps and at the last step (`checkpoint.interval`, which says the disk each costs), all
    kept unless `checkpoint.keep_last` is set; `checkpoint.interval = 0` turns them off. A run directory holding
    committed checkpoints is only continued (`--resume`), never started afresh."""

    resume: bool = False
    """`--resume`: continue the run in output_dir from its newest committed checkpoint: later steps' rollouts,
    weights, checkpoints and metrics.jsonl records are deleted, the trainer loads the checkpoint, inference is given
    that step's weights (verified, and evaluated first with online evaluation on), and training goes on to
    max_steps. With no committed checkpoint the run starts over at
    step 0 (saying so). Use the config of the original run (same seed, batch and environment)."""

    resume_step: int | None = Field(None, ge=1)
    """`--resume-step N`: like `resume`, from the committed checkpoint of step N (later ones are deleted)."""

    inference: InferenceConfig
    orchestrator: OrchestratorConfig
    trainer: TrainerConfig
    launch: LaunchConfig = LaunchConfig()
    deployment: DeploymentConfig = DeploymentConfig()
    monitor: MonitorConfig = MonitorConfig()
    """Weights & Biases (the trainer's step records: both processes' metrics in one run) and Prometheus endpoints
    (trainer on monitor.prometheus_port, orchestrator on the next port); copied into both sections."""
    slurm: SlurmConfig | None = None
    """Present: submit the run as a Slurm job (see launch/slurm.py) instead of running it on this machine."""

    kubernetes: KubernetesConfig = KubernetesConfig()
    """Used only by `slipstream k8s render` (Kubernetes manifests for this run, docs/kubernetes.md)."""

    dry_run: bool = False
    """`--dry-run` (with [slurm]): write the job script and the node configs, print the sbatch command, submit
    nothing."""

    @model_validator(mode="before")
    @classmethod
    def _share_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        defaults = {"output_dir": "outputs/run", "seed": 0, "weights": WeightsConfig().model_dump()}
        checkpoint = _table(data.get("checkpoint"))
        if checkpoint is not None and "interval" not in checkpoint:  # the RL default, in every section too
            data["checkpoint"] = {**checkpoint, "interval": RL_CHECKPOINT_INTERVAL}
        for key, sections in _SHARED.items():
            value = data.get(key, defaults.get(key))
            if value is None:
                continue
            for section in sections:
                sub = _table(data.get(section))
                if sub is None:
                    continue  # not a table: field validation reports it, naming the section
                if key in sub and _norm(sub[key]) != _norm(value):
                    raise ValueError(
                        f"{section}.{key} differs from the top-level {key}; set {key} once at the top level"
                    )
                sub[key] = value
                data[section] = sub
        inf, orch = _table(data.get("inference")) or {}, _table(data.get("orchestrator"))
        if (nodes := _slurm_inference_nodes(data.get("slurm"), inf)) is not None:
            inf["deployment"] = {**(_table(inf.get("deployment")) or {}), "nodes": nodes}
            data["inference"] = inf
        if orch is None:
            return data
        for key, value in _derived_inference_urls(inf).items():
            orch.setdefault(key, value)
        trainer = _table(data.get("trainer"))
        cp = (_table((trainer or {}).get("parallel")) or {}).get("cp", 1)
        # The cp ranks of a group share one batch: the orchestrator writes one per group.
        launch = _table(data.get("launch")) or {}
        procs = _known_trainer_procs(launch, _table(data.get("deployment")) or {})
        nodes = launch.get("trainer_nodes", 1)
        if isinstance(procs, int) and isinstance(cp, int) and cp >= 1 and isinstance(nodes, int) and nodes >= 1:
            orch.setdefault("num_trainer_ranks", max(nodes * procs // cp, 1))
        resume = data.get("resume_step") or ("latest" if data.get("resume") is True else None)
        for section, sub in (("orchestrator", orch), ("trainer", trainer)):
            if sub is None:
                continue  # not a table: field validation reports it
            if section == "trainer":
                sub.setdefault("whole_run_checkpoints", True)
            if sub.get("resume_step", resume) != resume:
                raise ValueError(f"set {section}.resume_step with --resume or --resume-step at the top level instead")
            if resume is not None:
                sub["resume_step"] = resume
        if orch.get("seed_requests") and "chunked_prefill" not in inf:
            data["inference"] = {**inf, "chunked_prefill": False}  # vLLM CPU dies on seeded chunked prefill
        data["orchestrator"] = orch
        if trainer is not None:
            data["trainer"] = trainer
        return data

    @model_validator(mode="after")
    def _check_whole_run(self) -> "RLConfig":
        if not self.trainer.whole_run_checkpoints:
            raise ValueError(
                "trainer.whole_run_checkpoints must be true under `slipstream rl` (trainer and orchestrator state are "
                "checkpointed together); leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _check_ranks(self) -> "RLConfig":
        cp, procs = self.trainer.parallel.cp, self.trainer_procs()
        if procs is None:
            return self  # decided at launch from the visible GPUs; checked again then
        if procs % cp != 0:
            raise ValueError(
                f"trainer.parallel.cp ({cp}) must divide launch.num_trainer_procs ({procs}); change one of them"
            )
        if self.orchestrator.num_trainer_ranks != self.launch.trainer_nodes * procs // cp:
            raise ValueError(
                "orchestrator.num_trainer_ranks must equal launch.trainer_nodes x launch.num_trainer_procs / "
                "trainer.parallel.cp (one batch per group of cp ranks); set only launch.num_trainer_procs"
            )
        return self

    @model_validator(mode="after")
    def _check_nodes(self) -> "RLConfig":
        run, transport = self.deployment.run, self.weights.transport
        if self.launch.trainer_node_rank > 0 and run != ["trainer"]:
            raise ValueError(
                f"launch.trainer_node_rank = {self.launch.trainer_node_rank}: the trainer's other nodes run only the "
                f"trainer (node 0 runs the orchestrator), but deployment.run = {run}; set deployment.run = ['trainer']"
            )
        if "orchestrator" in run and "trainer" not in run and self.launch.num_trainer_procs is None:
            raise ValueError(
                "the orchestrator runs on this node without the trainer (deployment.run), so it cannot count the "
                "trainer's ranks; set launch.num_trainer_procs to the trainer node's number of ranks"
            )
        split = ("inference" in run) != ("trainer" in run)
        if transport == "auto" and len(run) < 3:
            raise ValueError(
                f"only part of the run starts on this node (deployment.run = {run}), and every node must agree on "
                "how weights travel: set weights.transport explicitly ('nccl' between GPU nodes, 'filesystem' on a "
                "shared filesystem)"
            )
        inference_host = urlparse(self.orchestrator.inference_url).hostname or ""
        remote = inference_host not in LOOPBACK and inference_host != "localhost"
        if transport in ("nccl", "gloo") and split and remote and self.weights.master_addr in LOOPBACK:
            raise ValueError(
                f"weights.transport = {transport!r} with inference on another machine ({inference_host}) "
                f"(deployment.run = {run}): set weights.master_addr to the trainer node's address, reachable from "
                "the inference node (or use weights.transport = 'filesystem' on a shared filesystem)"
            )
        if transport == "ipc" and (split or remote):
            raise ValueError(
                f"weights.transport = 'ipc' shares memory between the trainer and inference of one machine, but "
                f"{'only part of the run starts here' if split else f'inference runs on {inference_host}'}; use "
                "'nccl', 'gloo' or 'filesystem'"
            )
        if transport == "nccl" and self.deployment.gpus == []:
            raise ValueError(
                "weights.transport = 'nccl' needs GPUs, but deployment.gpus = [] runs on CPU; use 'gloo' or "
                "'filesystem' (or 'auto'), or give the run GPUs"
            )
        return self

    @model_validator(mode="after")
    def _check_slurm(self) -> "RLConfig":
        if self.slurm is None:
            if self.dry_run:
                raise ValueError("--dry-run only applies to a Slurm submission: add a [slurm] section, or drop it")
            return self
        if "run" in self.deployment.model_fields_set:
            raise ValueError(
                "deployment.run is chosen for each node by [slurm] (slurm.num_nodes); remove deployment.run"
            )
        for key in ("trainer_nodes", "trainer_node_rank", "trainer_master_addr"):
            if key in self.launch.model_fields_set:
                raise ValueError(
                    f"launch.{key} is set for each node by [slurm] (slurm.trainer_nodes); remove launch.{key}"
                )
        if self.slurm.num_nodes > 1 and self.weights.transport == "ipc":
            raise ValueError(
                f"slurm.num_nodes = {self.slurm.num_nodes} puts inference and the trainer on different nodes; "
                "weights.transport = 'ipc' shares memory on one machine: use 'nccl', 'gloo' or 'filesystem'"
            )
        if self.slurm.num_nodes > 1 and self.weights.transport == "auto":
            raise ValueError(
                f"slurm.num_nodes = {self.slurm.num_nodes} puts inference and the trainer on different nodes, which "
                "must agree on how weights travel: set weights.transport ('filesystem' through the shared run "
                "directory, 'nccl' between GPU nodes, 'gloo' between CPU nodes)"
            )
        deployment, inference_nodes = self.inference.deployment, self.slurm.num_inference_nodes
        if deployment.kind == "single_node" and inference_nodes > 1:
            raise ValueError(
                f"slurm.num_nodes = {self.slurm.num_nodes} gives inference {inference_nodes} nodes (all but the "
                f"trainer's {self.slurm.trainer_nodes}), "
                "but inference.deployment.kind = 'single_node' runs on one; set kind = 'multi_node' (replicas or "
                "wide-EP across them) or 'disaggregated', or slurm.num_nodes = slurm.trainer_nodes + 1"
            )
        if len(deployment.nodes) != inference_nodes and (
            self.slurm.num_nodes > 1 or "nodes" in deployment.model_fields_set
        ):
            raise ValueError(
                f"inference.deployment.nodes lists {len(deployment.nodes)} node(s), but the Slurm job has "
                f"{inference_nodes} inference node(s) (slurm.num_nodes - slurm.trainer_nodes, or 1 on one node) and "
                "fills in their hostnames itself; drop inference.deployment.nodes, or change slurm.num_nodes"
            )
        return self

    @model_validator(mode="after")
    def _check_router_replay(self) -> "RLConfig":
        launched = "inference" in self.deployment.run
        if self.orchestrator.router_replay and launched and not self.inference.enable_return_routed_experts:
            raise ValueError(
                "orchestrator.router_replay needs the routed experts of every request: set "
                "inference.enable_return_routed_experts = true"
            )
        if self.orchestrator.router_replay and self.model.vlm is not None:
            raise ValueError(
                "orchestrator.router_replay replays experts in Slipstream's own MoE models, but [model.vlm] models "
                "train through transformers (trainer.model_impl 'hf'); set orchestrator.router_replay = false"
            )
        return self

    @model_validator(mode="after")
    def _check_no_stall(self) -> "RLConfig":
        self.weights.check_no_stall_lora(self.model.lora is not None)
        return self

    @model_validator(mode="after")
    def _check_sleep_level(self) -> "RLConfig":
        if self.deployment.sleep_level == 2 and self.model.lora is not None and self.deployment.colocate is not False:
            raise ValueError(
                "deployment.sleep_level = 2 frees vLLM's weights while the trainer steps, but with model.lora only the "
                "adapter is sent back, never the base weights: use deployment.sleep_level = 1 (or 0)"
            )
        return self

    def trainer_procs(self) -> int | None:
        """Trainer ranks on this node as far as the config fixes them (launch.num_trainer_procs, else the trainer's
        GPU count, 1 on CPU); None: decided at launch from the visible GPUs."""
        return _known_trainer_procs(self.launch.model_dump(), self.deployment.model_dump())

    def user_toml_dict(self) -> dict[str, Any]:
        """This config as a user writes it (what `-c` loads back, dotted overrides included): the shared fields
        only at the top level, the derived ones (orchestrator.num_trainer_ranks, the inference URLs the inference
        table gives, the sections' resume_step) left out."""
        data = self.to_toml_dict()
        for key, sections in _SHARED.items():
            for section in sections:
                data[section].pop(key, None)
        _drop_derived(data)
        self._drop_defaulted(data)
        for section in ("orchestrator", "trainer"):
            data[section].pop("resume_step", None)
        return data

    def rebuilt(self, changes: dict[str, Any]) -> "RLConfig":
        """This config with `changes` merged in (nested tables merge) and validated again, so shared fields are
        copied into the sections again and derived ones (orchestrator.num_trainer_ranks) derived again. Raises
        ConfigError naming the key."""
        from slipstream.config.loader import deep_merge, validate_config

        data = self.model_dump()
        for key, sections in _SHARED.items():
            for section in sections:
                data[section].pop(key, None)
        _drop_derived(data)
        self._drop_defaulted(data)
        return validate_config(RLConfig, deep_merge(data, changes))

    def _drop_defaulted(self, data: dict[str, Any]) -> None:
        """Remove from a dump the fields whose default is decided later when left unset, so that validating the dump
        again leaves them unset: model.dtype (bfloat16 on GPUs at launch, else float32)."""
        if "dtype" not in self.model.model_fields_set:
            data["model"].pop("dtype", None)


def _known_trainer_procs(launch: dict[str, Any], deployment: dict[str, Any]) -> int | None:
    """launch.num_trainer_procs if set, else the trainer's GPU count when the deployment fixes it (1 on CPU), else
    None. Works on raw (unvalidated) tables: values of the wrong type give None, and field validation reports them."""
    procs = launch.get("num_trainer_procs")
    if procs is not None:
        return procs if isinstance(procs, int) else None
    try:
        deployment_config = DeploymentConfig.model_validate(deployment)
    except ValueError:
        return None  # field validation reports it
    if "trainer" not in deployment_config.run:
        return 1  # no trainer on this node: _check_nodes asks for launch.num_trainer_procs where it matters
    known = deployment_config.known_trainer_gpus()
    return None if known is None else max(known, 1)


SLURM_NODE_PLACEHOLDER = "slurm-node-"
"""inference.deployment.nodes of a Slurm job (slurm-node-0, ...) until each node's script passes the hostnames."""


def _slurm_inference_nodes(slurm: Any, inf: dict[str, Any]) -> list[str] | None:
    """Under [slurm] with N >= 2 nodes, a multi-node deployment kind and inference.deployment.nodes unset:
    placeholders for the first N - 1 nodes
    (the job's inference nodes), so that a deployment's shape (prefill.nodes, decode.nodes) validates before the
    hostnames are known. None otherwise (invalid tables are left to field validation)."""
    slurm_table, deployment = _table(slurm), _table(inf.get("deployment"))
    if not slurm_table or deployment is None or "nodes" in deployment:
        return None
    if deployment.get("kind") not in ("multi_node", "disaggregated"):
        return None  # one inference node: _check_slurm says so if the job has more
    try:
        slurm_config = SlurmConfig.model_validate(slurm_table)
    except ValueError:
        return None  # field validation reports it
    if slurm_config.num_nodes < 2:
        return None
    return [f"{SLURM_NODE_PLACEHOLDER}{k}" for k in range(slurm_config.num_inference_nodes)]


def _derived_inference_urls(inf: dict) -> dict[str, Any]:
    """orchestrator.inference_url and orchestrator.inference_engine_urls as the inference table gives them (what they
    are unless set)."""
    host = inf.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return {"inference_url": f"http://{host}:{inf.get('port', 8000)}", "inference_engine_urls": _engine_urls(inf)}


def _drop_derived(data: dict[str, Any]) -> None:
    """Remove from a dumped config the fields derived when validating it (orchestrator.num_trainer_ranks, and the
    inference URLs where they equal what the inference table gives): validating it again derives them from its
    current values (a changed inference port, or the hostnames a Slurm node fills into inference.deployment.nodes)."""
    orch = data["orchestrator"]
    orch.pop("num_trainer_ranks", None)
    for key, value in _derived_inference_urls(data["inference"]).items():
        if orch.get(key) == value:
            orch.pop(key)


def _engine_urls(inf: dict) -> list[str]:
    """The engines' URLs when a router fronts them (else []); [] too when the inference table is invalid (its own
    validation reports it)."""
    try:
        deployment = InferenceDeploymentConfig.model_validate(inf.get("deployment") or {})
    except ValueError:
        return []
    wide_ep = deployment.kind == "multi_node" and inf.get("enable_expert_parallel") is True
    if not uses_router(deployment, wide_ep):
        return []
    port = inf.get("port", 8000)
    return [s.url for s in engine_slots(deployment, port if isinstance(port, int) else 8000, wide_ep) if s.serves_http]


def _table(value: Any) -> dict[str, Any] | None:
    """A section given as a table (or a config object) as a fresh dict; {} if absent; None if it is not a table."""
    if value is None:
        return {}
    if isinstance(value, dict | BaseModel):
        return dict(value)
    return None


def _norm(value: Any) -> Any:
    if isinstance(value, BaseConfig):
        return value.model_dump()
    if isinstance(value, Path):
        return str(value)
    return value
