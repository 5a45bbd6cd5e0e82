"""Config of one node's share of a `slipstream rl` run: which processes run here and which GPUs each one gets.

Only the request is checked here (torch-free, device-free); the visible GPUs are known at launch, where
slipstream.launch.placement turns this into per-process CUDA_VISIBLE_DEVICES and counts.
"""

from typing import Literal

from pydantic import model_validator

from slipstream.config.base import BaseConfig

Role = Literal["inference", "orchestrator", "trainer"]

ROLES: tuple[Role, ...] = ("inference", "orchestrator", "trainer")


class DeploymentConfig(BaseConfig):
    """Which processes run on this node and how its GPUs are split between vLLM and the trainer.

    GPU ids are those this node's launcher sees: the entries of its CUDA_VISIBLE_DEVICES when that is set, else
    nvidia-smi's indices. Each child gets its own CUDA_VISIBLE_DEVICES (the orchestrator none). Defaults, with n
    GPUs: inference and trainer both here: n // 2 for vLLM (1 of 2), the rest for the trainer; only one of them
    here: all n. No GPU visible (or `gpus = []`): everything runs on CPU, as on a laptop."""

    run: list[Role] = list(ROLES)
    """Processes started on this node. A subset runs a multi-node job: e.g. `["inference"]` on one node and
    `["trainer", "orchestrator"]` on another, with orchestrator.inference_url pointing at the inference node (and
    weights.master_addr at the trainer node for nccl/gloo weight transfer)."""

    gpus: list[int] | None = None
    """GPUs of this node the run may use; None: every visible one (decided at launch, not when parsing).
    `[]`: run on CPU even where GPUs exist."""

    inference_gpus: int | list[int] | None = None
    """GPUs for vLLM: a count (the first free ones of `gpus`) or explicit ids. Must equal
    inference.tensor_parallel_size x inference.data_parallel_size. None: the default split (see above). Ignored
    where inference does not run (deployment.run), so one file can serve every node."""

    trainer_gpus: int | list[int] | None = None
    """GPUs for the trainer: a count (the last free ones of `gpus`) or explicit ids. torchrun starts one
    rank per GPU (launch.num_trainer_procs follows it). None: the default split (see above). Ignored where the
    trainer does not run (deployment.run)."""

    colocate: bool | None = None
    """vLLM and the trainer on the same GPU(s), taking turns: the orchestrator generates a batch, puts vLLM to sleep
    (`sleep_level`), the trainer trains on it and publishes the new weights (weights.transport `ipc`: CUDA IPC, no
    files), vLLM wakes, loads them and generates the next batch. One GPU (`gpus = [i]` on a larger node): the trainer's
    first rank lays out each version for vLLM's workers to map, which a second GPU could not. None: colocated when
    inference, the trainer and the orchestrator run here on exactly one GPU, with neither inference_gpus nor
    trainer_gpus set (one GPU could not be split); false otherwise. true on CPU runs the same alternating schedule (vLLM's CPU build frees no memory when asleep).
    Needs the orchestrator here too (it drives the turns). See docs/colocate.md."""

    sleep_level: Literal[0, 1, 2] = 1
    """What vLLM gives up while the trainer has the GPU (colocated runs; vLLM's sleep mode, `--enable-sleep-mode`):
    1: its KV cache is freed and its weights are moved to CPU memory (default; the trainer gets all but vLLM's
    CUDA context and graphs); 2: weights freed too, nothing copied (each version is loaded whole anyway: faster than
    1 where host memory is slow or short; not with model.lora, whose base weights are never sent again; the run's
    first turn uses level 1 so the weight check can calibrate on the initial weights); 0: nothing is freed, vLLM only
    stops scheduling (when both fit side by side: no sleep/wake cost, and the trainer keeps its allocator's cache between
    steps, where levels 1 and 2 make it allocate its activations afresh each step: SmolLM2-135M on an H200 steps 2.2x
    faster in the trainer and 1.46x in steps/hour at level 0)."""

    split_cpu_cores: bool = True
    """On a node without GPUs that runs vLLM and the trainer side by side (not colocated), with trainer.num_threads
    set: give the trainer's threads cores of their own (the last ones of the launcher's cores, or those vLLM's binding
    leaves), and vLLM's processes and the orchestrator the others, as CPU affinities; vLLM's threads bind to its cores
    (an equal share per vLLM rank) unless inference.cpu_threads_bind (or VLLM_CPU_OMP_THREADS_BIND) names them.
    Otherwise only vLLM's worker threads are bound, and its API server and engine core and the orchestrator run on the
    trainer's core whenever vLLM's own core is busy: on a 2-core VM (the reverse-text demo) the trainer then trained at
    ~45 tokens/s against ~74 alone. false: no affinities (the kernel places every process)."""

    @model_validator(mode="after")
    def _check_roles(self) -> "DeploymentConfig":
        if not self.run or len(set(self.run)) != len(self.run):
            raise ValueError(
                f"deployment.run must list each of {', '.join(ROLES)} at most once, and at least one (got {self.run})"
            )
        return self

    @model_validator(mode="after")
    def _check_colocate(self) -> "DeploymentConfig":
        if not self.colocate:
            return self
        if missing := [role for role in ROLES if role not in self.run]:
            raise ValueError(
                f"deployment.colocate = true needs inference, the trainer and the orchestrator on this node (it drives "
                f"their turns on the GPU), but deployment.run leaves out {', '.join(missing)}; run all three here, or "
                "set colocate = false"
            )
        if self.inference_gpus is not None or self.trainer_gpus is not None:
            raise ValueError(
                "deployment.colocate = true gives the GPU of deployment.gpus to both vLLM and the trainer; drop "
                "deployment.inference_gpus / deployment.trainer_gpus (choose the GPUs with deployment.gpus)"
            )
        return self

    @model_validator(mode="after")
    def _check_ids(self) -> "DeploymentConfig":
        lists = {"gpus": self.gpus, "inference_gpus": self.inference_gpus, "trainer_gpus": self.trainer_gpus}
        for name, ids in lists.items():
            if isinstance(ids, int) and ids < 1:
                raise ValueError(f"deployment.{name} must be a GPU count >= 1 or a list of GPU ids (got {ids})")
            if isinstance(ids, list) and any(i < 0 for i in ids):
                raise ValueError(f"deployment.{name} lists a negative GPU id ({ids}); GPU ids start at 0")
            if isinstance(ids, list) and len(set(ids)) != len(ids):
                raise ValueError(f"deployment.{name} lists a GPU twice ({ids}); list each id once")
        inf, trainer = self.inference_gpus, self.trainer_gpus
        if isinstance(inf, list) and isinstance(trainer, list) and (shared := sorted(set(inf) & set(trainer))):
            raise ValueError(
                f"deployment.inference_gpus and deployment.trainer_gpus share GPU(s) {shared}; give each GPU to one "
                "of them"
            )
        for name in ("inference_gpus", "trainer_gpus"):
            ids = lists[name]
            if isinstance(ids, list) and self.gpus is not None and (extra := sorted(set(ids) - set(self.gpus))):
                raise ValueError(
                    f"deployment.{name} lists GPU(s) {extra} that deployment.gpus ({self.gpus}) leaves out; "
                    f"add them to deployment.gpus or change deployment.{name}"
                )
        if self.gpus == [] and (inf is not None or trainer is not None):
            raise ValueError(
                "deployment.gpus = [] runs on CPU, so deployment.inference_gpus / deployment.trainer_gpus cannot be "
                "set; drop them, or list GPUs in deployment.gpus"
            )
        return self

    def known_trainer_gpus(self) -> int | None:
        """The trainer's GPU count on this node when the config alone fixes it: 0 on CPU (`gpus = []`), else the
        count or list length of trainer_gpus; None when it is decided at launch or the trainer runs elsewhere."""
        if "trainer" not in self.run:
            return None
        if self.gpus == []:
            return 0
        if isinstance(self.trainer_gpus, list):
            return len(self.trainer_gpus)
        return self.trainer_gpus
