"""Multi-tenant LoRA state: several runs' adapters on one frozen base model, each with its own AdamW.

Every tenant owns its own nn.Parameter objects for all adapter tensors. `activate` points the model's LoRA modules
at one tenant's parameters (a pointer swap, no copy); the tenant's optimizer was built over exactly those objects.
So a step of tenant A reads and writes A's adapter, gradients and moments only: the frozen base weights are shared
and never change, and every other tenant's tensors are not touched at all (bit-identical), which is what makes one
tenant's step, failure or departure invisible to the others. Single process (no FSDP): the swap rebinds plain
parameters.
"""

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from slipstream.config.tenants import TenantConfig, TenantTrainerConfig, tenant_trainer_config
from slipstream.config.trainer import TrainerConfig
from slipstream.models.common.lora import init_adapters, is_lora_name
from slipstream.monitor.metrics import MetricsWriter, merge_metrics
from slipstream.rundir import RunDir
from slipstream.trainer.ckpt import load_checkpoint, resolve_resume_step
from slipstream.trainer.rl import NonFiniteGuard, maybe_checkpoint
from slipstream.trainer.schedule import apply_lr
from slipstream.trainer.setup import Trainer, build_optimizer
from slipstream.trainer.step import train_step
from slipstream.transport.rollouts import TrainingBatch
from slipstream.weights.send.publish import WeightPublisher

AdapterParams = dict[str, nn.Parameter]
"""Qualified parameter name (`model.layers.0.self_attn.q_proj.lora_A`) -> one tenant's tensor."""


def adapter_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Qualified name -> (module, attribute) of every adapter parameter of `model`, in module order."""
    slots = {}
    for prefix, module in model.named_modules():
        for attr, _ in module.named_parameters(recurse=False):
            if is_lora_name(attr):
                slots[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
    if not slots:
        raise ValueError(f"this {type(model).__name__} has no LoRA adapters (apply_lora first)")
    return slots


def activate(model: nn.Module, params: AdapterParams) -> None:
    """Make `params` the adapters `model` computes with (and that its parameters() yield)."""
    for name, (module, attr) in adapter_slots(model).items():
        module._parameters[attr] = params[name]  # same module, other tensor: hooks and names stay


def active_params(model: nn.Module) -> AdapterParams:
    return {name: module._parameters[attr] for name, (module, attr) in adapter_slots(model).items()}


def new_adapter(model: nn.Module, seed: int) -> AdapterParams:
    """Fresh adapter tensors for a tenant (initialised from `seed` alone), made active in `model`."""
    params = {n: nn.Parameter(torch.empty_like(p.data)) for n, p in active_params(model).items()}
    activate(model, params)
    init_adapters(model, seed)
    return params


@dataclass
class TenantRun:
    """One tenant inside the shared trainer: its config, adapter, optimizer, progress and outputs."""

    tenant: TenantConfig
    config: TrainerConfig
    """The one-run trainer config it trains under (its run directory, steps, optimizer, loss, checkpoints)."""
    params: AdapterParams
    view: Trainer
    """The shared Trainer with this tenant's optimizer and progress (model, device and tokenizer are shared)."""
    publisher: WeightPublisher
    writer: MetricsWriter
    nonfinite: NonFiniteGuard
    joined_stamp: float
    """mtime_ns of the tenant.toml it joined with (a newer one is a rejoin)."""
    last_progress: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.tenant.name

    @property
    def step(self) -> int:
        """Last step trained."""
        return self.view.start_step

    @property
    def done(self) -> bool:
        return self.step >= self.tenant.max_steps


def build_tenant(shared: Trainer, shared_config: TenantTrainerConfig, tenant: TenantConfig, stamp: float) -> TenantRun:
    """A tenant's adapter (from its seed), AdamW and publisher; resumed from its checkpoint when
    `tenant.resume_step` is set."""
    run_dir = shared_config.tenants_dir / tenant.name
    check_fresh_outputs(RunDir(run_dir), tenant.resume_step or 0)
    config = tenant_trainer_config(shared_config, tenant, run_dir)
    params = new_adapter(shared.model, tenant.seed)
    optimizer = build_optimizer(shared.policy, config, shared.device)
    view = dataclasses.replace(shared, optimizer=optimizer, start_step=0)
    step = resolve_resume_step(run_dir, config.resume_step, config.whole_run_checkpoints)
    if step is not None:
        load_checkpoint(shared.policy, optimizer, run_dir, view.checkpoint_meta(step), shared.info)
        view.start_step = step
    return TenantRun(
        tenant=tenant,
        config=config,
        params=params,
        view=view,
        publisher=WeightPublisher(view, config, adapters=True),
        writer=MetricsWriter(run_dir),
        nonfinite=NonFiniteGuard(config.max_nonfinite_steps),
        joined_stamp=stamp,
    )


def check_fresh_outputs(run: RunDir, start: int) -> None:
    """Refuse to start a tenant at step `start` whose run directory already holds later weights: after a restart
    of the trainer (or a second registration) its orchestrator is further on than the state the trainer would
    start from, and both must go back to one committed checkpoint together."""
    later = [s for s in run.published_steps() if s > start]
    if later:
        raise RuntimeError(
            f"{run.weights_root} holds weights of steps {later}, after step {start} this tenant would start from "
            "(the trainer restarted, or the tenant registered again): rejoin with `slipstream tenant-run --resume "
            "true`, which sets trainer and orchestrator back to the newest committed checkpoint"
        )


def train_tenant_step(run: TenantRun, batch: TrainingBatch) -> dict:
    """Step `batch.step` of one tenant: train its adapter, publish it under the tenant's name, log, checkpoint.
    Only this tenant's tensors change."""
    view, config, step = run.view, run.config, batch.step
    activate(view.model, run.params)
    run.view.optimizer.zero_grad(set_to_none=True)  # a failed earlier attempt may have left gradients
    t_start = time.perf_counter()
    apply_lr(view.optimizer, config.optim, step, config.max_steps)  # this tenant's own schedule
    metrics = train_step(
        view.policy, view.optimizer, batch, config.loss, config.optim.max_grad_norm, view.device, view.autocast_dtype
    )
    t_train = time.perf_counter()
    metrics["nonfinite/total"] = run.nonfinite.update(step, bool(metrics["nonfinite/skipped"]))
    metrics |= run.publisher.publish(step)
    metrics |= {
        "tokens_per_s": metrics["num_tokens"] / max(t_train - t_start, 1e-9),
        "timing/train_s": t_train - t_start,
        "timing/publish_s": time.perf_counter() - t_train,
    }
    record = run.writer.write(step, merge_metrics(batch.metrics, metrics))
    maybe_checkpoint(view, config, step)
    view.start_step = step
    run.last_progress = time.monotonic()
    return record


def run_dir_of(config: TenantTrainerConfig, name: str) -> RunDir:
    return RunDir(config.tenants_dir / name)
