"""Config of the trainer: model implementation, parallelism, optimizer, loss, checkpoints, device and timeouts."""

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.monitor import MonitorConfig
from slipstream.config.shared import CheckpointConfig, ModelConfig
from slipstream.config.weights import WeightsConfig


class ParallelConfig(BaseConfig):
    """How the trainer's ranks (torchrun's WORLD_SIZE) are arranged: a device mesh
    (dp_replicate, dp_shard, cp) whose product must equal the world size; ep divides the dp_shard x cp ranks.

    With one rank nothing is sharded. With several, FSDP2 shards every transformer block and the rest of the model
    over dp_shard x cp (HSDP: replicated over dp_replicate); with ep > 1 the experts are split over ep ranks and
    FSDP-sharded over the rest (parallel/mesh.py). Each group of cp ranks trains on its own batch file of a step.
    """

    dp_replicate: int = Field(1, ge=1)
    """Data-parallel replicas (HSDP): each replica holds a full copy sharded over its dp_shard ranks."""

    dp_shard: int | None = Field(None, ge=1)
    """Ranks that shard parameters, gradients and optimizer state (FSDP); default: world_size / (dp_replicate x cp)."""

    ep: int = Field(1, ge=1)
    """Expert-parallel degree for MoE models run by our implementation (qwen3_moe, model_impl "custom"): each MoE
    layer's experts are split over ep ranks taken from dp_shard x cp, and each token travels once to every rank of
    its ep group and its partial result back (all-to-all; parallel/ep.py). Best while ep <= the model's top-k (one
    node): beyond it each rank sends ep / top-k times more than a per-expert exchange would. Must divide the number
    of experts, and be a multiple of cp when both are > 1."""

    cp: int = Field(1, ge=1)
    """Context-parallel degree for our implementation (model_impl "custom"): each packed micro-batch's tokens are
    split over cp ranks (padded to a multiple of cp), and attention all-gathers keys and values (parallel/cp.py).
    The cp ranks of a group read one batch file, so the orchestrator writes world_size / cp batches per step."""

    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them (less memory, ~1/3 more
    compute). Applies with any number of ranks."""

    activation_checkpointing_keep_attention: bool = True
    """With activation_checkpointing: keep each block's attention output (and its log-sum-exp) instead of rerunning
    the attention kernel in backward: about tokens x heads x head_dim x 2 bytes more per block, one attention
    forward less per block (parallel/ac.py). false = full recomputation."""

    @model_validator(mode="after")
    def _check_ep_spans_cp(self) -> "ParallelConfig":
        if self.ep > 1 and self.cp > 1 and self.ep % self.cp != 0:
            raise ValueError(
                f"trainer.parallel.ep ({self.ep}) must be a multiple of trainer.parallel.cp ({self.cp}) when both are "
                "> 1: an expert-parallel group spans whole context-parallel groups; change ep or cp"
            )
        return self


class OptimConfig(BaseConfig):
    """AdamW with gradient-norm clipping."""

    lr: float = Field(1e-6, gt=0.0)
    """Learning rate. The peak: warm-up and the scheduler scale it per step (trainer/schedule.py)."""

    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up: step s <= warmup_steps trains at lr x s / warmup_steps."""

    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: "constant" keeps `lr`; "linear" and "cosine" decay it from `lr` towards lr x min_lr_ratio,
    reached one step after max_steps (the last step still trains). A function of the step alone: resuming needs no
    scheduler state, and a resumed run follows the same rates."""

    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Where "linear" and "cosine" decay to, as a fraction of `lr`."""

    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""

    eps: float = Field(1e-8, gt=0.0)
    """Adam epsilon."""

    max_grad_norm: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""

    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of AdamW's two moments (the master weights stay float32 either way):
    - "float32" (default): torch's AdamW (fused on CUDA), 8 bytes of optimizer state per parameter.
    - "bfloat16": 4 bytes per parameter (trainer/optim.py); with the float32 masters and gradients, 12 bytes per
      parameter instead of 16 (5.6B parameters of an 8-layer Qwen3-30B-A3B cut: 62.7 instead of 83.6 GiB).
      Accuracy cost: the moments keep ~3 significant digits and are rounded stochastically (unbiased), so each
      update carries a small relative noise against float32 AdamW (the total update of a tiny model over 6 steps
      is 0.2% off, tests/unit/test_moe_speed_path.py); the update maths runs in float32, one parameter at a time,
      so the step is slower than the fused kernel."""

    cpu_offload: bool = False
    """Keep the float32 masters, their gradients and the AdamW moments in CPU memory (FSDP2's CPUOffloadPolicy):
    GPU memory then holds only the bf16 parameters of the blocks in use and the activations. Needs GPUs and FSDP
    (trainer.device cuda, several ranks); an error otherwise. No accuracy cost (same maths, float32 on the CPU);
    the cost is speed: gradients and parameters cross PCIe every step and the optimizer step runs on the CPU."""


class LossConfig(BaseConfig):
    """Token-level RL loss (trainer/loss.py): one policy-gradient rule (`kind`) + squared log-ratio penalty.

    Every kind adds `kl_coef * log_ratio^2` per loss token and divides the sum by the step's loss-token count.
    Fields of the kinds not selected are ignored.
    """

    kind: Literal["dppo_tv", "tis", "icepop", "geo_mask"] = "dppo_tv"
    """Policy-gradient rule, with ratio = exp(lp - lq) of trainer (lp) vs inference (lq) log-probs, advantage A:
    - "dppo_tv" (default): DPPO binary trust region. `-(keep * A * ratio)`; a token is masked when its probability
      already moved past `dp_threshold` in the direction A pushes (`A > 0 and dp > thr` or `A <= 0 and dp < -thr`,
      dp = exp(lp) - exp(lq)).
    - "tis": token truncated importance sampling. `-(min(ratio, tis_cap).detach() * A * log_ratio)`: the
      REINFORCE gradient `-(w * A * grad lp)` with the weight truncated at `tis_cap`; no token is masked.
    - "icepop": `-(keep * A * ratio)`, masking tokens whose ratio is outside [icepop_low, icepop_high].
    - "geo_mask": `-(keep * A * ratio)`, masking every token of a sample whose geometric-mean ratio
      exp(mean of log_ratio over its loss tokens) is outside [geo_low, geo_high].
    """

    dp_threshold: float = Field(0.2, gt=0.0)
    """dppo_tv: mask a token when its probability moved by more than this in the direction its advantage pushes."""

    kl_coef: float = Field(1e-3, ge=0.0)
    """Weight of the squared log-ratio (trainer vs inference) penalty (all kinds)."""

    tis_cap: float = Field(2.0, gt=0.0)
    """tis: importance weights are truncated at this value (C)."""

    icepop_low: float = Field(0.5, ge=0.0)
    """icepop: mask tokens whose ratio is below this."""

    icepop_high: float = Field(5.0, gt=0.0)
    """icepop: mask tokens whose ratio is above this."""

    geo_low: float = Field(0.5, ge=0.0)
    """geo_mask: mask a whole sample when its geometric-mean ratio is below this."""

    geo_high: float = Field(2.0, gt=0.0)
    """geo_mask: mask a whole sample when its geometric-mean ratio is above this."""

    @model_validator(mode="after")
    def _check_bounds(self) -> "LossConfig":
        for name, low, high in (("icepop", self.icepop_low, self.icepop_high), ("geo", self.geo_low, self.geo_high)):
            if not low < 1.0 < high:
                raise ValueError(
                    f"trainer.loss.{name}_low ({low}) must be < 1 < trainer.loss.{name}_high ({high}), "
                    "so that on-policy tokens (ratio 1) are kept"
                )
        return self


class ProbeConfig(BaseConfig):
    """A fixed prompt whose log-probs the trainer publishes with every weight update, to verify the sync."""

    text: str = "Reverse the text: hello world. Answer: dlrow olleh"
    """Probe text; it is tokenized with the model's tokenizer."""


def check_profile_steps(value: list[int], name: str) -> list[int]:
    """`name`'s steps sorted, once each; a step below 1 is refused."""
    if bad := [s for s in value if s < 1]:
        raise ValueError(f"{name} are step numbers, >= 1 (got {bad}): steps count from 1")
    return sorted(set(value))


class TrainerConfig(BaseConfig):
    """Trains the policy on the orchestrator's batches and publishes weights."""

    model: ModelConfig
    """Model to train (initial weights)."""

    model_impl: Literal["auto", "custom", "hf"] = "auto"
    """Model implementation the trainer runs:
    - "custom": Slipstream's own modules (slipstream/models: llama, qwen3, qwen3_moe): packed micro-batches run
      without padding, the LM head is chunked, MoE experts are grouped; an error for other model types.
    - "hf": plain transformers (AutoModelForCausalLM); packed samples run as right-padded rows.
    - "auto" (default): "custom" when the HF config's model_type is one of ours, else "hf".
    Both publish the same Hugging Face checkpoint layout, so inference is unaffected by this choice. (A trainer
    field rather than `model.impl`: `model` is shared by all processes and set once at the top level.)"""

    packed_attention: Literal["varlen", "flex"] = "varlen"
    """Attention kernel for rows that pack several samples or prefix trees (model_impl "custom"): "varlen" = flash
    attention varlen on GPUs (prefix trees written out as their samples there), the masked reference elsewhere;
    "flex" = flex_attention with a block mask of the samples and trees (compiled; GPUs only: torch's flex has no
    CPU backward), which keeps prefix trees as trees. Measured (benchmarks/RESULTS.md): per layer on an H100 flex is
    12-14% faster than flash varlen; a whole step of 8 x 2048 packed tokens on an H200 runs 86,010 tokens/s with flex
    against 81,274-81,948 with varlen (no activation checkpointing). Not the default yet: RL micro-batches change
    length every step, and flex's compiled kernel under changing lengths is not measured yet."""

    fp8: bool = False
    """FP8 block-scaled training (DeepSeek-V3's recipe, models/common/fp8.py): the attention q/k/v/o and dense MLP
    projections and the MoE experts run their GEMMs in float8 e4m3, weights in 128x128 blocks and activations in
    1x128 tiles with a float32 scale each; the master weights stay float32 and the LM head, router, embeddings and
    norms keep the compute dtype. Forward and input-gradient GEMMs are FP8, weight-gradient GEMMs in the compute dtype.
    Needs model_impl "custom" (an error with "hf", or when "auto" resolves to it) and, on GPUs, an SM90 GPU
    (H100/H200) with a CUDA >= 12.9 build of torch; any other GPU is an error, never a silent bf16 fallback. On
    CPU it runs the float32 reference (dequantize, then matmul): same quantization, slower than plain float32, meant
    for tests and the CPU twin. Trade-off: faster GEMMs for up to 2^-4 relative rounding per weight and
    activation element; meant to run against FP8 block-quantized inference (same quantization), whose log-probs it
    should match more closely than a bf16 trainer does (benchmarks/fp8_training.py measures both)."""

    output_dir: Path
    """Run directory."""

    max_steps: int = Field(ge=1)
    """Number of optimizer steps."""

    seed: int = 0
    """Seed of the trainer's RNG."""

    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    probe: ProbeConfig = ProbeConfig()
    parallel: ParallelConfig = ParallelConfig()

    monitor: MonitorConfig = MonitorConfig()
    """Weights & Biases and Prometheus (config/monitor.py). Under `slipstream rl` set once at the top level."""

    weights: WeightsConfig = WeightsConfig()
    """How the trainer publishes weights for inference (transport, buckets, rendezvous, retention). Under
    `slipstream rl` set once at the top level."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    """When to write checkpoints (model, optimizer, progress, RNG; torch.distributed.checkpoint) into
    `output_dir/checkpoints/step_N/trainer/`, and which to keep. Under `slipstream rl` set once at the top level."""

    whole_run_checkpoints: bool = False
    """Commit whole-run checkpoints: after writing its part of step N, wait (up to 60 s; it is written before the
    step's batch) for the orchestrator's part and write `checkpoints/step_N/COMMITTED`; resume and retention then
    count only such steps. `slipstream rl` sets it. False: trainer-only checkpoints (`trainer/COMMITTED` suffices),
    for a trainer fed batches by something else."""

    resume_step: int | Literal["latest"] | None = None
    """Resume from the checkpoint of this step before training: an int (that checkpoint must exist), "latest"
    (the newest committed one; starts from scratch, saying so, when there is none) or None (start from scratch).
    A checkpoint loads at any number of ranks. Under `slipstream rl` use --resume / --resume-step instead."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training device; auto picks CUDA when available."""

    colocated: bool = False
    """The trainer shares its GPU with vLLM (deployment.colocate; `slipstream rl` sets it): it logs its peak memory of
    each step (`memory/peak_allocated_gib`, `memory/peak_reserved_gib`)."""

    release_cached_memory: bool = False
    """After each step and after each publish, return the memory the allocator caches to the GPU, so that a colocated
    vLLM can wake into it (`slipstream rl` sets it when colocated with deployment.sleep_level >= 1; at level 0 vLLM
    keeps its memory and the trainer keeps its cache: each step after a release allocates its activations afresh)."""

    compile: bool = False
    """torch.compile each transformer block (after activation checkpointing, before FSDP): Inductor fuses the
    elementwise work around the matmuls (RMSNorm, RoPE, SwiGLU, residual adds, casts). Costs a compilation at the
    first step (and when shapes change); results equal eager up to float rounding. Meant for GPUs; on CPU it needs
    a C++ compiler and rarely pays off."""

    num_threads: int | None = Field(None, ge=1)
    """torch CPU threads per rank (default: torch's choice)."""

    batch_timeout_s: float = Field(3600.0, gt=0.0)
    """How long to wait for the orchestrator's batch of a step."""

    max_nonfinite_steps: int = Field(3, ge=1)
    """A step whose gradient norm is NaN/inf is skipped (weights unchanged, still published so the run keeps its
    cadence) and counted; after this many such steps in a row the trainer stops with an error."""

    profile_steps: list[int] = []
    """Steps whose training (forward, backward, optimizer step: what `tokens_per_s` times) runs under torch.profiler;
    each rank writes `profiles/trainer_step<N>_rank<R>.txt` (wall time, the device's and the host's busy time, the top
    operators) and `.json` (a Chrome trace, for Perfetto) in the output folder. Profiling slows those steps; pick
    steps after the first two (compilation, warm-up). Empty: no profiling."""

    @field_validator("profile_steps")
    @classmethod
    def _check_profile_steps(cls, value: list[int]) -> list[int]:
        return check_profile_steps(value, "trainer.profile_steps")

    @field_validator("resume_step")
    @classmethod
    def _check_resume_step(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"trainer.resume_step must be >= 1, 'latest' or unset (got {value})")
        return value

    @model_validator(mode="after")
    def _check_fp8_impl(self) -> "TrainerConfig":
        if self.packed_attention == "flex" and self.model_impl == "hf":
            raise ValueError(
                "trainer.packed_attention = 'flex' runs in Slipstream's own models: set model_impl = 'custom' or "
                "'auto', or packed_attention = 'varlen'"
            )
        if self.fp8 and self.model.lora is not None:
            raise ValueError(
                "trainer.fp8 = true with [model.lora] is not supported (the FP8 layers have no adapters); set fp8 = "
                "false or remove [model.lora]"
            )
        if self.fp8 and self.model_impl == "hf":
            raise ValueError(
                "trainer.fp8 = true needs trainer.model_impl 'custom' or 'auto' (FP8 layers are swapped into "
                "Slipstream's own models); set model_impl = 'custom' or fp8 = false"
            )
        return self

    @model_validator(mode="after")
    def _check_vlm_trainable(self) -> "TrainerConfig":
        """[model.vlm] models run through transformers (the vision encoder and M-RoPE are transformers' own)."""
        if self.model.vlm is None:
            return self
        if self.model_impl == "custom":
            raise ValueError(
                "[model.vlm] models run through transformers (vision encoder, M-RoPE positions of image tokens), not "
                "Slipstream's own model implementation: set trainer.model_impl = 'hf' or 'auto'"
            )
        if self.fp8 or self.parallel.cp > 1 or self.parallel.ep > 1:
            raise ValueError(
                "[model.vlm] models run through transformers, which has no FP8 layers, context or expert parallelism "
                f"here (got fp8 = {str(self.fp8).lower()}, parallel.cp = {self.parallel.cp}, parallel.ep = "
                f"{self.parallel.ep}): set fp8 = false, cp = 1 and ep = 1"
            )
        return self
