"""Config pieces shared by several processes."""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.vlm import VLMConfig, check_vlm_dtype, check_vlm_lora, check_vlm_model_type, model_type_of

LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts")
"""Attention and MLP projections of every family (their Hugging Face names) and the stacked MoE experts."""


class LoRAConfig(BaseConfig):
    """Low-rank adapters (LoRA): each targeted weight W is used as W + (alpha / rank) * B @ A with A [rank, in] and
    B [out, rank] trained and W frozen (models/common/lora.py); B starts at zero, so step 0 is the base model. Only
    the adapters are in the optimizer and in checkpoints; published weights are a PEFT adapter (adapter_config.json +
    adapter_model.safetensors) that inference serves under `name`, and SFT's final folder is the merged model."""

    rank: int = Field(16, ge=1)
    """Rank r of each adapter (vLLM is started with --max-lora-rank of at least this)."""

    alpha: float = Field(32.0, gt=0.0)
    """Scale numerator: the adapter adds (alpha / rank) * B @ A x."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during training (as PEFT's lora_dropout). Non-zero makes the trainer's
    log-probs differ from inference's in RL; keep 0 there."""

    target_modules: list[str] = Field(list(LORA_DEFAULT_TARGETS), min_length=1)
    """Module names that get adapters: a linear layer whose own name (the last part of its path, e.g. `q_proj`) is
    listed, and every stacked-experts module (gate/up/down of each expert, one adapter per expert) when `experts` is
    listed. The default covers attention and MLP projections of every family and MoE experts; names a model lacks are
    skipped, and an error is raised when nothing matches."""

    name: str = Field("policy-lora", min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    """Name inference serves the adapter under (the model name the orchestrator requests in RL)."""

    max_loras: int = Field(1, ge=1)
    """Adapters inference serves at once (vLLM --max-loras): 1 for one run; at least the number of tenants of a
    multi-tenant trainer (docs/multi_tenant_lora.md), each served under its tenant's name."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class ModelConfig(BaseConfig):
    """Which model to train and serve."""

    name: str
    """The model, and the name inference serves it under: a local Hugging Face model folder; a known alias such as
    `smollm2-135m-instruct` (imported on first use into the model cache, see `slipstream model import`); a name
    imported there before (a GGUF file stem); or a Hugging Face Hub id such as `Qwen/Qwen3-0.6B`, downloaded once
    into the Hugging Face cache (HF_HUB_CACHE; set HF_TOKEN for gated or private repos, HF_HUB_OFFLINE=1 to use the
    cache only). A local folder wins over a hub id of the same spelling."""

    revision: str | None = Field(None, min_length=1)
    """For a Hugging Face Hub id: the branch, tag or commit hash to use (None: `main`). Pin a commit hash to make a
    run reproducible."""

    path: Path | None = None
    """The local folder `name` (at `revision`) resolved to. `slipstream rl` sets it before starting any process, so
    every process reads the same folder and none resolves or downloads the model again; leave it unset."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype inference serves and weights are published in; also the trainer's compute dtype (its master
    weights and optimizer state stay float32). float32 keeps CPU runs exact; left unset, it becomes bfloat16 where the
    work runs on GPUs: `slipstream rl` when its processes get GPUs (deployment), `slipstream sft` when it trains on
    CUDA."""

    head_dtype: Literal["float32", "model"] = "float32"
    """Dtype of the LM head's output (the logits), the same on the trainer and in vLLM. "float32" (default): the
    head's bfloat16 product is kept in float32 on both sides (vLLM: `--hf-overrides '{"head_dtype": "float32"}'`), as
    ScaleRL and MiniMax-M1 recommend for RL; "model": logits rounded to `dtype`, vLLM's own default. Rounding logits
    to bfloat16 (steps of 1/16 between 8 and 16) turns the two sides' tiny differences into whole steps: on 2 x H200
    the step-1 trainer-inference mismatch KL fell from 1.9e-3 to 8.4e-4 (SmolLM2-135M) and from 9.6e-3 to 1.9e-5 (the
    Qwen3-0.6B shape) with "float32" (docs/gpu.md). Costs the trainer a float32 copy of each LM-head chunk's logits
    (+2.5 GB at 8192 tokens x 152k vocabulary); nothing changes with dtype float32."""

    lora: LoRAConfig | None = None
    """`[model.lora]`: train low-rank adapters on the frozen model instead of all its weights; None: full
    fine-tuning."""

    vlm: VLMConfig | None = None
    """`[model.vlm]`: the model is a vision-language model (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) whose
    prompts may hold images; needs dtype "bfloat16". None: a text model (a VLM checkpoint then trains as text only)."""

    @model_validator(mode="after")
    def _check_vlm(self) -> "ModelConfig":
        if self.vlm is None:
            return self
        check_vlm_dtype(self.dtype, defaulted="dtype" not in self.model_fields_set)
        check_vlm_lora(self.vlm, has_lora=self.lora is not None)
        if self.path is not None:
            check_vlm_model_type(model_type_of(self.path), self.name)
        return self

    @model_validator(mode="after")
    def _check_revision(self) -> "ModelConfig":
        if self.revision is not None and "/" not in self.name:
            raise ValueError(
                f"model.revision only applies to Hugging Face Hub ids (org/name), and model.name '{self.name}' is "
                "not one; unset model.revision, or set model.name to a hub id"
            )
        return self


class CheckpointConfig(BaseConfig):
    """Whole-run checkpoints in `output_dir/checkpoints/step_N/`: the trainer's model, optimizer and RNG (DCP) and
    the orchestrator's data position, committed together by one `step_N/COMMITTED` marker (see
    slipstream.transport.checkpoints). `slipstream rl --resume` continues from the newest committed one."""

    interval: int = Field(0, ge=0)
    """Checkpoint every this many steps and at the last step; 0: never. A checkpoint costs about 12 bytes of disk per
    trained parameter: the float32 master weights and AdamW's two float32 moments (8 bytes with
    `optim.state_dtype = "bfloat16"`; with LoRA only the adapters count), so ~1.6 GB for a 135M model, ~7 GB for
    0.6B, ~360 GB for 30B; `keep_last` bounds how many stay on disk."""

    keep_last: int | None = Field(None, ge=1)
    """Keep only the newest this many committed checkpoints (plus those `keep_every` keeps); None: keep all. The
    newest committed checkpoint and checkpoints still being written are never deleted."""

    keep_every: int | None = Field(None, ge=1)
    """With keep_last: also keep the checkpoints of steps divisible by this (e.g. 100 keeps step_100, step_200)."""

    @model_validator(mode="after")
    def _check_retention(self) -> "CheckpointConfig":
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError(
                "checkpoint.keep_every only matters with checkpoint.keep_last (without it every checkpoint is kept); "
                "set checkpoint.keep_last too, or drop keep_every"
            )
        return self
