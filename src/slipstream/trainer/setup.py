"""Build everything the trainer loop needs: ranks and process group, model (ours or transformers'), parallelism,
optimizer, tokenizer, probe tokens, and the state of a checkpoint to resume from."""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.models.common.fp8 import apply_fp8
from slipstream.models.common.lora import apply_lora, init_adapters
from slipstream.models.common.moe import find_grouped_experts
from slipstream.parallel.cp import ContextParallel
from slipstream.parallel.dist import RankInfo, barrier, init_distributed, rank_device, read_rank_info
from slipstream.parallel.fsdp import fsdp_param_dtype, parallelize_model
from slipstream.parallel.mesh import ParallelDims, build_mesh, resolve_parallel_dims
from slipstream.rundir import RunDir
from slipstream.trainer.ckpt import CheckpointMeta, load_checkpoint, resolve_resume_step
from slipstream.trainer.optim import AdamWBf16Moments
from slipstream.trainer.policy import Policy, load_model
from slipstream.weights.send.folder import build_probe_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def head_dtype_of(model: ModelConfig) -> torch.dtype | None:
    """The LM head's logits dtype for Policy and the probe: float32 with model.head_dtype = "float32" (the default; a
    no-op for a float32 model), None (the compute dtype) with "model"."""
    return torch.float32 if model.head_dtype == "float32" else None


@dataclass
class Trainer:
    """Everything the loop needs, built once by setup_trainer."""

    model: nn.Module
    """The model (ours or transformers'); its blocks are FSDP-sharded with several ranks."""
    policy: nn.Module
    """Policy(model): what train_step calls and the optimizer updates (the FSDP root)."""
    tokenizer: "PreTrainedTokenizerBase"
    optimizer: torch.optim.Optimizer
    device: torch.device
    info: RankInfo
    probe_token_ids: list[int]
    compute_dtype: torch.dtype
    """config.model.dtype: forward/backward compute dtype and the dtype of the published weights."""
    autocast_dtype: torch.dtype
    """Dtype of autocast around the forward (float32: none): the compute dtype unless FSDP already all-gathers the
    parameters in it (GPUs with several ranks)."""
    impl: str
    """Resolved model implementation: "custom" or "hf"."""
    hf_config: Any
    """transformers config of the model folder."""
    model_dir: Path
    """The HF folder the initial weights came from."""
    data_rank: int = 0
    """Index of the batch file this rank trains on (the ranks of one cp group share it)."""
    num_data_ranks: int = 1
    """Batch files per step: world_size / cp."""
    start_step: int = 0
    """Last step already trained (from the checkpoint resumed from); the loop starts at start_step + 1."""
    owns_process_group: bool = False
    image_inputs: Any = None
    """[model.vlm]: builds a micro-batch's image inputs (trainer/vlm_batch.py ImageProcessorInputs); None: text."""

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    def checkpoint_meta(self, step: int) -> CheckpointMeta:
        return CheckpointMeta(step=step, model_type=self.hf_config.model_type, impl=self.impl)


def setup_trainer(config: TrainerConfig) -> Trainer:
    """Seed, threads, ranks, device, model, parallelism, AdamW, tokenizer, probe tokens, resume.

    The model is always loaded in float32: those are the master weights AdamW updates (a bf16 update of size
    lr ~ 1e-6 would round away). config.model.dtype sets the compute dtype and the published dtype.
    """
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    info = read_rank_info()
    dims = resolve_parallel_dims(config.parallel, info.world_size)  # fail on a bad mesh before any heavy work
    torch.manual_seed(config.seed)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = rank_device(select_device(config.device).type, info)
    owns_process_group = init_distributed(info, device)
    hf_logging.disable_progress_bar()

    model_dir = resolve_model_once(config.model, info)
    model, impl = load_model(model_dir, config.model_impl, vlm=config.model.vlm is not None)
    vision_blocks = setup_vision_encoder(model, config)
    check_parallel_fits_model(dims, model, impl)
    if config.packed_attention != "varlen":
        if impl != "custom":
            raise ValueError(
                f"trainer.packed_attention = {config.packed_attention!r} needs Slipstream's own model, but "
                f"model_impl resolved to {impl!r} for this model type: use packed_attention = 'varlen'"
            )
        if device.type != "cuda":
            raise ValueError(
                f"trainer.packed_attention = {config.packed_attention!r} is a GPU kernel (torch's flex_attention has "
                f"no backward on {device.type}): use packed_attention = 'varlen' there"
            )
        model.packed_attention = config.packed_attention
    if config.fp8:  # swap in the FP8 layers before any parallelism wraps them (models/common/fp8.py)
        apply_fp8(model, device)
    setup_lora(model, config)
    compute_dtype = DTYPES[config.model.dtype]
    mesh = build_mesh(dims, device.type) if info.world_size > 1 else None
    context_parallel = ContextParallel(mesh.cp) if mesh is not None and mesh.cp is not None else None
    policy = parallelize_model(
        Policy(model, context_parallel=context_parallel, head_dtype=head_dtype_of(config.model)),
        mesh,
        config.parallel,
        compute_dtype,
        compile=config.compile,
        experts=find_grouped_experts(model),
        cpu_offload=config.optim.cpu_offload,
        extra_blocks=vision_blocks,
    )
    if mesh is None:
        policy.to(device)
    autocast_dtype = compute_dtype
    if mesh is not None and fsdp_param_dtype(compute_dtype, device.type) == compute_dtype:
        autocast_dtype = torch.float32
    optimizer = build_optimizer(policy, config, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    trainer = Trainer(
        model=model,
        policy=policy,
        tokenizer=tokenizer,
        optimizer=optimizer,
        device=device,
        info=info,
        probe_token_ids=build_probe_token_ids(tokenizer, config.probe.text),
        compute_dtype=compute_dtype,
        autocast_dtype=autocast_dtype,
        impl=impl,
        hf_config=hf_config,
        model_dir=model_dir,
        data_rank=dims.data_rank(info.rank),
        num_data_ranks=dims.num_data_ranks,
        owns_process_group=owns_process_group,
    )
    if config.model.vlm is not None:
        from slipstream.trainer.vlm_batch import ImageProcessorInputs

        trainer.image_inputs = ImageProcessorInputs.from_config(model_dir, hf_config)
    maybe_resume(trainer, config)
    return trainer


def setup_vision_encoder(model: nn.Module, config: TrainerConfig) -> list[nn.Module]:
    """[model.vlm]: freeze the vision encoder (the default: no gradients, so out of the optimizer) and return no
    extra FSDP units; with freeze_vision_encoder = false return its blocks, each its own FSDP unit. Text models: []."""
    from slipstream.trainer.vlm_logprobs import freeze_vision_encoder

    vlm = config.model.vlm
    if vlm is None:
        return []
    if not vlm.freeze_vision_encoder:
        return list(model.model.visual.blocks)
    num_frozen = freeze_vision_encoder(model)
    if read_rank_info().is_main:
        log.info(f"vision encoder frozen: {num_frozen:,} parameters left out of the optimizer")
    return []


def setup_lora(model: nn.Module, config: TrainerConfig) -> None:
    """With `model.lora`: add the adapters (initialised from trainer.seed alone) and freeze the base weights, before any
    parallelism wraps the model."""
    lora = config.model.lora
    if lora is None:
        return
    adapted = apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    init_adapters(model, config.seed)  # from the seed alone: a multi-tenant trainer's tenant starts alike
    if read_rank_info().is_main:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        log.info(f"LoRA rank {lora.rank} on {len(adapted)} modules: {trainable:,} of {total:,} parameters trained")


def check_parallel_fits_model(dims: ParallelDims, model: nn.Module, impl: str) -> None:
    """Expert and context parallelism need our model implementation (and EP a mixture of experts whose expert
    count ep divides): say which trainer.parallel field to change otherwise."""
    if dims.cp > 1 and impl != "custom":
        raise ValueError(
            f"trainer.parallel.cp = {dims.cp} needs trainer.model_impl = 'custom' (context parallelism lives in our "
            "attention); set model_impl = 'custom' for a supported model type, or cp = 1"
        )
    if dims.cp > 1 and not getattr(model, "supports_context_parallel", True):
        raise ValueError(
            f"trainer.parallel.cp = {dims.cp}: {type(model).__name__} has layers that context parallelism cannot split "
            "exactly (recurrent linear attention carries a state along each sample); set cp = 1"
        )
    if dims.ep == 1:
        return
    if not getattr(model, "supports_expert_parallel", True):
        raise ValueError(
            f"trainer.parallel.ep = {dims.ep}: {type(model).__name__} is not supported with expert parallelism (the "
            "family runs without it, as the model table says; no EP parity test covers it); set ep = 1"
        )
    experts = find_grouped_experts(model) if impl == "custom" else []
    if not experts:
        raise ValueError(
            f"trainer.parallel.ep = {dims.ep} needs a mixture-of-experts model run by our implementation "
            f"(model_impl 'custom', e.g. qwen3_moe); this {impl} {type(model).__name__} has no experts: set ep = 1"
        )
    for module in experts:
        if module.num_experts % dims.ep != 0:
            raise ValueError(
                f"trainer.parallel.ep = {dims.ep} must divide the number of experts ({module.num_experts}); pick an "
                "ep that divides it"
            )


def build_optimizer(policy: nn.Module, config: TrainerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the float32 masters: torch's with float32 moments (on CUDA the fused implementation, one kernel for
    all parameters), or with `optim.state_dtype = "bfloat16"` trainer/optim.py's bf16 moments. With
    `optim.cpu_offload` FSDP already put masters and gradients in CPU memory (parallel/fsdp.py): the moments follow
    them and the step runs on the CPU."""
    optim = config.optim
    if optim.cpu_offload and (device.type != "cuda" or not isinstance(policy, FSDPModule)):
        raise ValueError(
            "trainer.optim.cpu_offload offloads FSDP's sharded state from GPUs to CPU memory: it needs trainer.device "
            f"'cuda' and several ranks (torchrun); this run has device {device.type} and "
            f"{'FSDP' if isinstance(policy, FSDPModule) else 'no FSDP'}: set cpu_offload = false"
        )
    if optim.cpu_offload and any(p.device.type != "cpu" for p in policy.parameters()):
        raise RuntimeError("trainer.optim.cpu_offload is set but parallelize_model left parameters on the GPU")
    hyper = dict(lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
    params = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    if optim.state_dtype == "bfloat16":
        return AdamWBf16Moments(params, **hyper)
    fused = device.type == "cuda" and not optim.cpu_offload
    return torch.optim.AdamW(params, **hyper, fused=True if fused else None)


def maybe_resume(trainer: Trainer, config: TrainerConfig) -> None:
    """Load the checkpoint `config.resume_step` selects (if any) and set trainer.start_step."""
    step = resolve_resume_step(config.output_dir, config.resume_step, config.whole_run_checkpoints)
    if step is None:
        return
    load_checkpoint(trainer.policy, trainer.optimizer, config.output_dir, trainer.checkpoint_meta(step), trainer.info)
    trainer.start_step = step
    if trainer.info.is_main:
        log.info(f"resumed from {RunDir(config.output_dir).checkpoint_dir(step)} at {trainer.world_size} rank(s)")


def teardown_trainer(trainer: Trainer) -> None:
    """Leave the process group if setup_trainer created it. All ranks meet first: a rank that tears gloo down while a
    peer still has traffic in flight makes that peer abort ("terminate called without an active exception")."""
    if trainer.owns_process_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def resolve_model_once(model: ModelConfig, info: RankInfo) -> Path:
    """The folder of `model`: `model.path` when the launcher resolved it; else rank 0 resolves first (an alias is
    imported, a hub id downloaded, only once) and the other ranks then read it from the cache without downloading."""
    from slipstream.models.resolve import resolve_model_config

    path = resolve_model_config(model) if info.is_main else None
    barrier()
    return path if path is not None else resolve_model_config(model, local_files_only=True)


def select_device(device: str) -> torch.device:
    """`auto` picks CUDA when available; an explicit `cuda` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device = 'cuda' but torch sees no CUDA device; set trainer.device = 'cpu'")
    return torch.device(device)
