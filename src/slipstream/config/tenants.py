"""Config of multi-tenant LoRA (docs/multi_tenant_lora.md): the shared trainer (`slipstream tenant-trainer`) and the
per-run settings a tenant registers with when it joins."""

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.inference import InferenceConfig
from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.config.shared import CheckpointConfig, ModelConfig
from slipstream.config.trainer import LossConfig, OptimConfig, ProbeConfig, TrainerConfig


class TenantConfig(BaseConfig):
    """One run ("tenant") of a shared LoRA trainer: its adapter, optimizer, loss and checkpoints. Written by the
    tenant into `<tenants_dir>/<name>/config/tenant.toml` when it joins; its run directory is `<tenants_dir>/<name>/`
    (also its orchestrator's output_dir)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    """Tenant name: its run directory's name and the adapter name inference serves it under (the orchestrator's
    model.lora.name)."""

    max_steps: int = Field(ge=1)
    """Steps this tenant trains; it leaves the trainer after the last one."""

    seed: int = 0
    """Seed of the adapter's initial A matrices (B starts at zero)."""

    optim: OptimConfig = OptimConfig()
    """This tenant's AdamW (learning rate, betas, clipping): its own state, stepped only on its batches."""

    loss: LossConfig = LossConfig()
    """This tenant's RL loss."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    """This tenant's whole-run checkpoints (its adapter + AdamW state, and its orchestrator's part); the same values
    as its orchestrator's `checkpoint`."""

    resume_step: int | None = Field(None, ge=1)
    """Step of this tenant's committed checkpoint to continue from (set by `join_tenant` when resuming)."""

    batch_timeout_s: float = Field(3600.0, gt=0.0)
    """A tenant whose next batch does not come for this long is dropped (marked failed); the others go on."""

    max_nonfinite_steps: int = Field(3, ge=1)
    """This many NaN/inf (skipped) steps in a row fail the tenant (only it)."""


class TenantTrainerConfig(BaseConfig):
    """One trainer process serving K LoRA runs on one frozen base model: each tenant has its own adapter, AdamW,
    checkpoints, metrics and run directory; runs join and leave while the others train."""

    model: ModelConfig
    """Base model shared by every tenant; `[model.lora]` (rank, alpha, targets) is the same for all tenants (its
    `name` is unused: each tenant's adapter is served under the tenant's name)."""

    tenants_dir: Path
    """Folder of the tenants' run directories (`<tenants_dir>/<name>/`); a tenant joins by writing its
    `config/tenant.toml` there."""

    max_tenants: int = Field(4, ge=1)
    """Tenants trained at once (inference's --max-loras must be at least this); later joiners wait for a slot."""

    model_impl: Literal["auto", "custom", "hf"] = "auto"
    """As trainer.model_impl."""

    probe: ProbeConfig = ProbeConfig()
    """Probe text whose log-probs are published with every adapter (the tenant's orchestrator verifies each load)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """As trainer.device (one rank: multi-tenant training is single-process)."""

    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads (None: torch's default)."""

    seed: int = 0
    """Process seed (model loading); each adapter's initial values come from its tenant's seed."""

    poll_s: float = Field(0.05, gt=0.0)
    """Sleep between scans when no tenant has a batch ready."""

    exit_when_idle_s: float | None = Field(None, gt=0.0)
    """Exit once no tenant has been registered and unfinished for this long (None: run until killed)."""

    @model_validator(mode="after")
    def _check_lora(self) -> "TenantTrainerConfig":
        if self.model.lora is None:
            raise ValueError("the multi-tenant trainer trains LoRA adapters: add [model.lora] (rank, alpha, targets)")
        if self.model.lora.dropout != 0.0:
            raise ValueError(
                "model.lora.dropout must be 0 with several tenants: dropout draws from the one process RNG they share, "
                "so one tenant's step would change another's training; set dropout = 0"
            )
        return self


def tenant_trainer_config(shared: TenantTrainerConfig, tenant: TenantConfig, run_dir: Path) -> TrainerConfig:
    """The single-run trainer config a tenant trains under: the shared model and device, the tenant's run
    directory, steps, optimizer, loss and checkpoints, its adapter served under its name. A one-tenant trainer
    (`slipstream trainer`) with this config trains exactly as the tenant does."""
    lora = shared.model.lora.model_copy(update={"name": tenant.name})
    return TrainerConfig(
        model=shared.model.model_copy(update={"lora": lora}),
        model_impl=shared.model_impl,
        output_dir=run_dir,
        max_steps=tenant.max_steps,
        seed=tenant.seed,
        optim=tenant.optim,
        loss=tenant.loss,
        probe=shared.probe,
        checkpoint=tenant.checkpoint,
        whole_run_checkpoints=tenant.checkpoint.interval > 0,
        resume_step=tenant.resume_step,
        device=shared.device,
        num_threads=shared.num_threads,
        batch_timeout_s=tenant.batch_timeout_s,
        max_nonfinite_steps=tenant.max_nonfinite_steps,
    )


class TenantRunConfig(BaseConfig):
    """`slipstream tenant-run`: join a running multi-tenant trainer as tenant `tenant.name` and run its orchestrator
    against the shared inference server. `model`, `tenants_dir` and the tenant's steps, seed and checkpoints are set
    once here and copied into the orchestrator (its output_dir is `<tenants_dir>/<name>`, its adapter name the
    tenant's name)."""

    model: ModelConfig
    """The shared base model, as in the trainer's config (with its `[model.lora]`)."""

    tenants_dir: Path
    """The trainer's tenants_dir."""

    tenant: TenantConfig
    """This run's adapter, optimizer, loss, steps and checkpoints."""

    resume: bool = False
    """`--resume`: continue this tenant from its newest committed checkpoint (later steps deleted), or start over
    when it has none; a registration it still holds is withdrawn first."""

    orchestrator: OrchestratorConfig
    """This tenant's orchestrator (environment, batch, sampling, inference_url of the shared server)."""

    @model_validator(mode="before")
    @classmethod
    def _share_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("tenant"), dict):
            return data
        orch, tenant, model = data.get("orchestrator"), data["tenant"], data.get("model")
        if not isinstance(orch, dict) or not isinstance(model, dict) or not isinstance(model.get("lora"), dict):
            return data  # field validation reports what is missing
        for key in ("model", "output_dir", "max_steps", "seed", "checkpoint"):
            if key in orch:
                raise ValueError(f"orchestrator.{key} is set from the tenant; set tenant.* / model instead")
        name = tenant.get("name")
        lora = {**model["lora"], "name": name}
        orch = {
            **orch,
            "model": {**model, "lora": lora},
            "output_dir": str(Path(str(data.get("tenants_dir", ""))) / str(name)),
            "max_steps": tenant.get("max_steps"),
            "seed": tenant.get("seed", 0),
            "checkpoint": tenant.get("checkpoint", {}),
        }
        return {**data, "orchestrator": orch}


class TenantServerConfig(BaseConfig):
    """`slipstream tenant-server`: the shared half of multi-tenant LoRA on this machine: the inference server (vLLM
    with --enable-lora --max-loras = model.lora.max_loras) and the multi-tenant trainer, started and supervised
    together; tenants then attach with `slipstream tenant-run`. `model` and `tenants_dir` are set once here."""

    model: ModelConfig
    """The base model and `[model.lora]` every tenant shares."""

    tenants_dir: Path
    """Folder of the tenants' run directories; also holds this server's config/, logs/ and admin_token."""

    inference: InferenceConfig
    trainer: TenantTrainerConfig

    health_timeout_s: float = Field(600.0, gt=0.0)
    """How long to wait for the inference server's /health before giving up."""

    shutdown_grace_s: float = Field(10.0, gt=0.0)
    """Seconds between SIGTERM and SIGKILL when stopping the two processes."""

    @model_validator(mode="before")
    @classmethod
    def _share_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for section in ("inference", "trainer"):
            sub = data.get(section, {})
            if not isinstance(sub, dict):
                continue  # field validation reports it
            if "model" in sub or (section == "trainer" and "tenants_dir" in sub):
                raise ValueError(f"{section}.model / {section}.tenants_dir are set once at the top level")
            data[section] = {**sub, "model": data.get("model")}
            if section == "trainer":
                data[section]["tenants_dir"] = data.get("tenants_dir")
        return data

    @model_validator(mode="after")
    def _check_slots(self) -> "TenantServerConfig":
        lora = self.model.lora
        if lora is not None and lora.max_loras < self.trainer.max_tenants:
            raise ValueError(
                f"model.lora.max_loras ({lora.max_loras}) must be at least trainer.max_tenants "
                f"({self.trainer.max_tenants}): vLLM must hold every training tenant's adapter; raise max_loras"
            )
        return self
