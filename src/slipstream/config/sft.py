"""Config of `slipstream sft`: supervised fine-tuning on chat data with the RL trainer's model, parallelism,
optimizer and checkpoints (trainer/sft.py)."""

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.shared import CheckpointConfig, ModelConfig
from slipstream.config.slurm import SlurmConfig
from slipstream.config.trainer import OptimConfig, ParallelConfig, TrainerConfig, check_profile_steps
from slipstream.config.weights import WeightsConfig


class SFTDataConfig(BaseConfig):
    """Training and validation data: local JSONL (`.jsonl`, one JSON object per line) or Parquet (`.parquet`,
    needs pyarrow) files. Each row holds either `messages` (a chat: `role`/`content` dicts, optionally with
    `tool_calls`) plus optional `tools` (OpenAI tool schemas, a list or its JSON string), or `prompt` +
    `completion` (each a string or a list of messages; a string prompt is one user message, a string completion
    one assistant message). Rows are rendered with the model's chat template."""

    train_files: list[Path] = Field(min_length=1)
    """Training files, read in this order (then shuffled per epoch when `shuffle`)."""

    val_files: list[Path] = []
    """Validation files: their mean loss per token (and perplexity) is logged every `val_interval` steps."""

    loss_roles: list[str] = Field(["assistant"], min_length=1)
    """Roles whose messages are trained on (loss tokens). An assistant message's loss covers what the template
    renders after the generation prompt (its content and end-of-turn tokens); another role's covers its whole
    rendered message."""

    shuffle: bool = True
    """Shuffle the training samples at every epoch (a permutation seeded by `seed` and the epoch)."""

    @field_validator("train_files", "val_files")
    @classmethod
    def _check_suffixes(cls, files: list[Path]) -> list[Path]:
        for path in files:
            if path.suffix not in (".jsonl", ".parquet"):
                raise ValueError(f"data file {path} must end in .jsonl or .parquet")
        return files


class SFTConfig(BaseConfig):
    """Supervised fine-tuning: cross-entropy on the chosen roles' tokens of chat data, one exact per-token mean
    per step over all ranks and micro-batches; validation loss, checkpoints that resume at the same sample, and at
    the end a Hugging Face model folder (`output_dir/weights/step_<max_steps>`) usable as `model.name`."""

    model: ModelConfig
    """Model to fine-tune (initial weights and tokenizer, whose chat template renders the data)."""

    model_impl: Literal["auto", "custom", "hf"] = "auto"
    """Model implementation, as `trainer.model_impl` of `slipstream trainer --help`."""

    data: SFTDataConfig
    """Training and validation files, trained roles and data order."""

    output_dir: Path
    """Run directory: metrics.jsonl, checkpoints/step_N/, weights/step_<max_steps>/ (the fine-tuned model)."""

    max_steps: int = Field(ge=1)
    """Number of optimizer steps; the data repeats (a new epoch) when it runs out."""

    batch_size: int = Field(ge=1)
    """Samples per optimizer step, over all ranks (each group of cp ranks takes a share)."""

    micro_batch_tokens: int = Field(ge=2)
    """Token budget of one packed micro-batch (one forward/backward) per rank: samples are packed into rows of at
    most this many tokens. A sample longer than this is an error naming its row."""

    shared_prefix: bool = True
    """Train the conversations of a micro-batch that begin with the same tokens (system prompt, chat template) as
    prefix trees: those tokens once, each conversation's remaining tokens attending to them (models/common/
    prefix_tree.py). Exact: only tokens without loss in every conversation of a tree are shared, so loss and gradients
    are those of the conversations one by one, with fewer tokens to compute; micro_batch_tokens counts a tree's tokens
    (its prefix once), so a micro-batch holds more conversations. Trees are chosen to save the most compute (on the
    CPU a tree's one row also pays attention over all its tokens, where each conversation could run in a padded row
    of its own). Used where the trainer runs trees as trees: on the CPU, and under context parallelism (parallel.cp >
    1). A CUDA trainer without context parallelism, a transformers model (model_impl = "hf") or a model with recurrent
    layers would write trees back out as their conversations (the same result, beyond micro_batch_tokens): there
    conversations are packed whole, as with False, and the log says so."""

    shared_prefix_min_tokens: int = Field(2, ge=1)
    """Shortest prefix worth sharing (shared_prefix)."""

    val_interval: int | None = Field(None, ge=1)
    """Compute the validation loss every this many steps and at the last step (needs data.val_files)."""

    seed: int = 0
    """Seed of the trainer's RNG and of the data order."""

    optim: OptimConfig = OptimConfig(lr=2e-5)
    """AdamW over float32 master weights and its learning-rate schedule (`optim.warmup_steps`, `optim.scheduler`), as
    the RL trainer's."""

    parallel: ParallelConfig = ParallelConfig()
    """FSDP / HSDP / EP / CP / activation checkpointing over torchrun's ranks, as the RL trainer's."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    """When to write checkpoints (model, optimizer, RNG and the data position) into `output_dir/checkpoints/step_N/`,
    and which to keep."""

    resume_step: int | Literal["latest"] | None = None
    """Resume from the checkpoint of this step (an int, or "latest"); None starts from scratch and refuses an
    output_dir that already holds checkpoints."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training device; auto: CUDA when this machine shows GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi), else the
    CPU. On CUDA, model.dtype defaults to bfloat16 (float32 on the CPU)."""

    num_procs: int | None = Field(None, ge=1)
    """Ranks on this machine. With more than one, `slipstream sft` starts itself again under torchrun
    (`--standalone --nproc-per-node`): one rank per GPU, on the first `num_procs` visible GPUs (gloo ranks on the
    CPU). None: one rank per visible GPU, 1 on the CPU. Not used under torchrun (started by hand, or by a [slurm] job,
    whose nodes run slurm.gpus_per_node ranks each)."""

    compile: bool = False
    """torch.compile each transformer block (see `slipstream trainer --help`)."""

    num_threads: int | None = Field(None, ge=1)
    """torch CPU threads per rank (default: torch's choice)."""

    profile_steps: list[int] = []
    """Steps whose training (the step's forward, backward and optimizer step) runs under torch.profiler, written to
    `profiles/` in the output folder, as `trainer.profile_steps` of `slipstream trainer --help`."""

    slurm: SlurmConfig | None = None
    """Present: `slipstream sft` submits the fine-tuning as a Slurm job instead of running it here: torchrun on
    every node of the job (slurm.num_nodes), slurm.gpus_per_node ranks each (1 without GPUs), a static rendezvous
    on the first node at `master_port` (launch/slurm_sft.py). `--dry-run` only writes the scripts."""

    master_port: int = Field(29400, ge=1, le=65535)
    """With [slurm]: port of torchrun's rendezvous on the job's first node."""

    dry_run: bool = False
    """`--dry-run` (with [slurm]): write the job script and the node config, print the sbatch command, submit
    nothing."""

    @field_validator("profile_steps")
    @classmethod
    def _check_profile_steps(cls, value: list[int]) -> list[int]:
        return check_profile_steps(value, "profile_steps")

    @field_validator("resume_step")
    @classmethod
    def _check_resume_step(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"resume_step must be >= 1, 'latest' or unset (got {value})")
        return value

    @model_validator(mode="after")
    def _check_slurm(self) -> "SFTConfig":
        if self.slurm is None:
            if self.dry_run:
                raise ValueError("--dry-run only applies to a Slurm submission: add a [slurm] section, or drop it")
            return self
        if self.num_procs is not None:
            raise ValueError(
                "num_procs sets the ranks of a run on this machine; a [slurm] job runs slurm.gpus_per_node ranks on "
                "each node: remove num_procs"
            )
        if "trainer_nodes" in self.slurm.model_fields_set:
            raise ValueError(
                "slurm.trainer_nodes places an RL run's trainer; every node of an SFT job trains: remove it"
            )
        return self

    @model_validator(mode="after")
    def _check_validation(self) -> "SFTConfig":
        if self.val_interval is not None and not self.data.val_files:
            raise ValueError("val_interval is set but data.val_files is empty; add validation files or unset it")
        return self

    def to_toml_dict(self) -> dict[str, Any]:
        """As BaseConfig's, but model.dtype left out when unset: the machine that trains decides it (bfloat16 on
        CUDA, float32 on the CPU), also when the config is written for torchrun's ranks or a Slurm job's nodes."""
        data = super().to_toml_dict()
        if "dtype" not in self.model.model_fields_set:
            data["model"].pop("dtype", None)
        return data

    def trainer_config(self) -> TrainerConfig:
        """The TrainerConfig whose setup (model, parallelism, optimizer, resume) and checkpoints SFT reuses."""
        return TrainerConfig(
            model=self.model,
            model_impl=self.model_impl,
            output_dir=self.output_dir,
            max_steps=self.max_steps,
            seed=self.seed,
            optim=self.optim,
            parallel=self.parallel,
            checkpoint=self.checkpoint,
            resume_step=self.resume_step,
            device=self.device,
            compile=self.compile,
            num_threads=self.num_threads,
            profile_steps=self.profile_steps,
            weights=WeightsConfig(transport="filesystem"),
        )
