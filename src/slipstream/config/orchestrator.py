"""Config of the orchestrator: rollouts, rewards, advantages, batching, staleness and in-flight concurrency."""

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.monitor import MonitorConfig
from slipstream.config.shared import CheckpointConfig, ModelConfig
from slipstream.config.weights import WeightsConfig


class SamplingConfig(BaseConfig):
    """Sampling parameters of rollouts."""

    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature. Trainer log-probs are computed at this temperature too."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling. Keep 1.0 for RL: the loss assumes the full temperature-scaled distribution."""

    max_tokens: int = Field(128, ge=1)
    """Most completion tokens per rollout."""


class EnvServerConfig(BaseConfig):
    """Whether the environment runs in its own process (an env server the orchestrator starts and supervises, one
    per environment, spoken to over ZMQ), so its dependencies and crashes stay out of the orchestrator. Model turns
    stay in the orchestrator (token-in/token-out); only chat messages, states and rewards cross. See
    docs/environments.md, "Environments in their own process"."""

    mode: Literal["auto", "process", "in_process"] = "auto"
    """`process`: run the environment in an env server; `in_process`: inside the orchestrator; `auto`: a process for
    third-party code that Slipstream cannot vouch for (`verifiers`), in-process for the rest."""

    on_crash: Literal["restart", "stop"] = "restart"
    """When the env server dies, its in-flight rollouts fail (counted in `pipeline/failed_rollouts` and
    `env_server/lost_rollouts`); then `restart` starts a new one (at most `max_restarts` times) and the run goes on,
    `stop` stops the run with a message naming the server's exit status and log."""

    max_restarts: int = Field(3, ge=0)
    """Most restarts of the env server per run with on_crash = 'restart'; one crash more stops the run."""

    startup_timeout_s: float = Field(300.0, gt=0.0)
    """Longest wait for a (re)started env server to load its environment and answer."""


class EnvConfig(BaseConfig):
    """Which environment produces tasks and rewards."""

    name: str = "reverse_text"
    """A built-in environment (reverse_text, alphabet_sort, wordle, calculator, swe_fix, count_shapes: images, for
    vision-language models, verifiers), a name an installed package registers under the `slipstream.environments`
    entry points (`slipstream env init NAME` writes one), or an import path `package.module:load_environment`
    (see docs/environments.md)."""

    args: dict[str, Any] = {}
    """Keyword arguments for the environment's loader or constructor (e.g. `num_tasks`, `min_words`). On the command
    line, `--orchestrator.env.args '{ num_tasks = 64 }'` replaces the config file's args (`'{}'`: none), and
    `--orchestrator.env.args.num_tasks 64` changes one of them."""

    server: EnvServerConfig = EnvServerConfig()
    """Where the environment runs: in the orchestrator or in its own supervised process (env server)."""


class AdvantageConfig(BaseConfig):
    """GRPO advantages: reward minus the group's mean reward."""

    std_normalize: bool = False
    """Divide by the group's reward standard deviation (Dr. GRPO recommends off)."""


class WeightCheckConfig(BaseConfig):
    """Verification of every weight update against the trainer's log-probs on a probe prompt."""

    enabled: bool = True
    """Score the trainer's probe on inference after each weight load and compare."""

    max_abs_diff: float | None = Field(None, gt=0.0)
    """Largest allowed |trainer - inference| log-prob difference on probe tokens, fixed. Unset: the larger of the
    dtype's tolerance (1e-3 for float32 models, 5e-2 for bfloat16: kernels round differently) and `floor_factor` x the
    floor measured by `calibrate`."""

    calibrate: bool = True
    """Before the first load, score the trainer's log-probs of the weights inference serves on inference: the
    difference on identical weights is the noise floor later loads are judged against (full-model updates; LoRA
    adapters keep the dtype's tolerance)."""

    max_floor_rise: float = Field(4.0, ge=1.0)
    """After the starting weights' floor, every load that passes is one more measurement on identical weights (it then
    serves the trainer's weights): the floor follows the largest difference of these, up to this many times the
    starting floor. The gap grows as the policy trains (SmolLM2-135M in float32 on an H200: 0.004-0.013 over the first
    loads, up to 0.039 by step 32), and one measurement of a short probe is noisy (0.0054 on one run's starting
    weights): a floor fixed at the start stopped 2 of 14 healthy runs within 30 steps, one fixed after 8 loads 1 of 6
    at step 32, while one that rose without bound would follow a steadily growing divergence instead of catching it.
    1: the starting weights' floor only."""

    floor_factor: float = Field(3.0, ge=1.0)
    """Loads may differ by this many times the floor's max; and a load counts as not taken when the trainer's policy
    moved by more than this many times the floor's mean while inference stayed closer to the previous version."""

    max_floor: float = Field(1.0, gt=0.0)
    """The largest floor accepted: above it trainer and inference disagree before any update (another model, revision
    or dtype), which the run stops on (see stop_on_failure)."""

    stop_on_failure: bool = True
    """Stop the run when a check fails: a frozen or corrupted policy must not train silently."""


class RecoveryConfig(BaseConfig):
    """What the orchestrator does when inference is lost mid-run (connection refused or dropped, HTTP 5xx, or a
    reply from a restarted server: `slipstream rl` restarts a dead inference server, see launch.inference_restarts).

    New requests are held back; /health is polled with exponential backoff; once it answers, the served weights
    are loaded again and verified with the weight check before any new request is sent. Requests that were in
    flight fail: their groups are generated again from scratch (`pipeline/regenerated_groups`), never trained
    half-done.
    """

    timeout_s: float = Field(900.0, gt=0.0)
    """Longest wait for inference to answer /health again (and take the served weights) after it was lost; the
    run then stops with an error saying what was waited for. Cover the server's restart (model load, warm-up)."""

    backoff_initial_s: float = Field(0.5, gt=0.0)
    """First delay between two /health polls while inference is lost; doubled after each poll."""

    backoff_max_s: float = Field(10.0, gt=0.0)
    """Longest delay between two /health polls."""

    max_regenerations_per_group: int = Field(3, ge=0)
    """How often one group may be generated again after losing its requests; beyond it the run stops (a request
    that itself brings the server down must not loop forever). 0: losing inference stops the run."""

    @model_validator(mode="after")
    def _check_backoff(self) -> "RecoveryConfig":
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(
                f"recovery.backoff_initial_s ({self.backoff_initial_s}) is above recovery.backoff_max_s "
                f"({self.backoff_max_s}); lower backoff_initial_s or raise backoff_max_s"
            )
        return self


class ConcurrencyConfig(BaseConfig):
    """How many completions (sequences; a group of `group_size` is one request) the orchestrator keeps in flight.

    adaptive: additive-increase / multiplicative-decrease on vLLM's `/metrics`. While the limit is what holds
    rollouts back and the server is healthy, the limit doubles per poll until the first back-off (slow start),
    then grows by `increase`. It is multiplied by `backoff_factor` when `vllm:num_requests_waiting` > 0 on
    `waiting_polls` consecutive polls (requests queue in the server) or when `vllm:num_preemptions_total`
    increased (the KV cache is overcommitted). Polls during a weight update are skipped.
    """

    mode: Literal["fixed", "adaptive"] = "adaptive"
    """fixed: always allow `max` completions in flight. adaptive: start at `min`; grow while the limit holds rollouts
    back and the server shows no queueing (doubling until the first back-off, then + `increase` per poll); multiply
    by `backoff_factor` on queueing or preemption."""

    min: int = Field(8, ge=1)
    """Adaptive: fewest completions allowed in flight (and the starting limit). A group larger than the limit is
    still sent, alone."""

    max: int = Field(256, ge=1)
    """Most completions in flight (the fixed cap in fixed mode). Keep it near the server's max_num_seqs."""

    increase: int = Field(8, ge=1)
    """Adaptive: completions added per healthy poll after the first back-off."""

    backoff_factor: float = Field(0.5, gt=0.0, lt=1.0)
    """Adaptive: the limit is multiplied by this on queueing or preemption (never below `min`)."""

    poll_interval_s: float = Field(1.0, gt=0.0)
    """Adaptive: seconds between two reads of the server's /metrics."""

    waiting_polls: int = Field(2, ge=1)
    """Adaptive: consecutive polls with waiting requests that trigger a back-off (one poll can catch requests
    that arrived between two scheduler steps)."""

    @model_validator(mode="after")
    def _check_range(self) -> "ConcurrencyConfig":
        if self.min > self.max:
            raise ValueError(
                f"concurrency.min ({self.min}) is above concurrency.max ({self.max}); lower min or raise max"
            )
        return self


class OnlineEvalConfig(BaseConfig):
    """Evaluation of the served policy on the environment's held-out split while training runs.

    The policy of version 0 (before training), every `interval`-th version and the final one are evaluated.
    Evaluation requests run beside rollouts, within a share of the in-flight limit, and never enter training
    batches. While an evaluation runs the served policy stays fixed (weight updates wait for it, at most
    `timeout_s`), so every sample of an evaluation comes from the version it is reported for. Results go into
    `<output_dir>/eval/online.jsonl` and into the metrics of a later batch, one evaluation per batch, oldest
    first (`eval/reward_mean`, `eval/pass@k`, `eval/policy_version`, ...; so into metrics.jsonl at that batch's
    step, not at the evaluated version's). Evaluations that end after the last batch, such as the final one, are
    only in online.jsonl. An evaluation running when the last batch is written finishes before the final policy is
    loaded and evaluated.
    Requests are unseeded (whatever `seed_requests` says): a CPU vLLM build with chunked prefill (the training server's default) crashes on
    seeded requests (see slipstream.eval.server); pass@k and the mean are then estimates with sampling noise.
    """

    interval: int = Field(0, ge=0)
    """Evaluate every `interval` policy versions (trainer steps), plus before training and at the end.
    0: no online evaluation."""

    split: str = "eval"
    """Environment split to evaluate on (held-out tasks are in `eval`)."""

    num_tasks: int | None = Field(None, ge=1)
    """Evaluate the first `num_tasks` tasks of the split. None: all of them."""

    num_samples: int = Field(1, ge=1)
    """Samples (rollouts) per task; pass@k is reported for k = 1, 2, 4, ... below it, and it."""

    pass_threshold: float = 1.0
    """A sample counts as solved for pass@k when its reward is >= this."""

    sampling: SamplingConfig | None = None
    """Sampling of evaluation requests. None: the rollouts' `sampling`."""

    max_share: float = Field(0.25, gt=0.0, le=1.0)
    """Most evaluation completions in flight, as a share of the in-flight limit (concurrency), at least 1.
    They count against that limit, so rollouts get the rest. The final evaluation, after the last batch, uses
    the whole limit."""

    timeout_s: float = Field(1800.0, gt=0.0)
    """An evaluation still running after this many seconds is cancelled, logged and counted
    (`eval/num_timeouts`), so weight updates are never held back longer. Lower num_tasks/num_samples if it hits."""

    @property
    def enabled(self) -> bool:
        return self.interval > 0


class ColocateConfig(BaseConfig):
    """The orchestrator's side of a colocated run (deployment.colocate): it hands the GPU to the trainer after each
    batch and takes it back with the trainer's new weights (orchestrator/colocate.py)."""

    sleep_level: int = Field(1, ge=0, le=2)
    """vLLM's sleep level while the trainer has the GPU (deployment.sleep_level, which `slipstream rl` copies here)."""


class OrchestratorConfig(BaseConfig):
    """Drives rollouts against inference and writes training batches."""

    model: ModelConfig
    """Model served by inference (its name is sent with every request)."""

    output_dir: Path
    """Run directory (`rollouts/`, `weights/`, `metrics.jsonl`, ...)."""

    max_steps: int = Field(ge=1)
    """Number of training steps (one batch each)."""

    seed: int = 0
    """Seed of task sampling (and of rollout requests with `seed_requests`)."""

    seed_requests: bool = False
    """Seed every rollout request from (seed, the task's position in the task stream, sample, turn), so the samples
    of a run are reproducible: with max_async_level = 0 a run (and a resumed run) trains on the same batches given
    the seed. Single-turn groups send one request seeded s (vLLM draws sample i with s + i); multi-turn rollouts
    seed turn t of sample i with s + i + t * group_size. The CPU build of vLLM crashes on seeded requests with chunked
    prefill on: `slipstream rl` turns it off (inference.chunked_prefill) unless set explicitly."""

    weights: WeightsConfig = WeightsConfig()
    """How weights reach inference: the orchestrator relays each update and prunes published folders. Under
    `slipstream rl` set once at the top level."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint steps: at each, the orchestrator writes its state (data position, counters) into
    `checkpoints/step_N/orchestrator/` before the step's batch (retention is the trainer's). Under `slipstream rl`
    set once at the top level."""

    resume_step: int | Literal["latest"] | None = None
    """Continue from the orchestrator state of this committed whole-run checkpoint (an int, or "latest"; None: start
    from scratch): serve that step's weights, then generate batch resume_step + 1 on. Groups that were in flight or
    buffered at the checkpoint are not restored; their tasks are generated again first. The run directory must hold
    nothing of later steps (`slipstream rl --resume` prepares it)."""

    inference_url: str = "http://127.0.0.1:8000"
    """Base URL of the vLLM server, or of the vllm-router in front of several engines (inference.deployment)."""

    inference_engine_urls: list[str] = []
    """Base URLs of every engine's API server when a router fronts them: admin calls (pause, weight transfer, resume,
    probe check) go to each directly (through the router they would reach one only). Empty: inference_url is the one
    engine. `slipstream rl` fills it from inference.deployment."""

    batch_size: int = Field(16, ge=1)
    """Rollouts per training step."""

    group_size: int = Field(4, ge=1)
    """Rollouts per task (GRPO group); must divide batch_size."""

    max_async_level: int = Field(1, ge=0)
    """How far the orchestrator may run ahead of the trainer: batch n is assembled (and rollouts for it started)
    only once inference serves policy version >= n - 1 - max_async_level, version v being the weights the
    trainer published after step v. Rollouts that carried over (see spare_batches) may be older, down to
    max_off_policy_steps. 0 = synchronous: every token of batch n comes from version n - 1."""

    spare_batches: int = Field(1, ge=0)
    """With max_async_level >= 1: extra groups, in batches' worth, started beyond those the batches the orchestrator
    may assemble need, while the trainer waits for batches (it was waiting when the last batch was taken). A batch
    is then made of the first groups to finish, and slow groups carry over to a later batch (their age bounded by
    max_off_policy_steps) instead of holding it back. 0: a batch waits for its own slowest group. Synchronous runs
    (max_async_level = 0) start exactly each batch's groups."""

    max_off_policy_steps: int = Field(8, ge=0)
    """Oldest token a batch may hold: a group whose oldest token is older than version
    n - 1 - max_off_policy_steps (n the step the batch is for) is cancelled in flight, or dropped if it has
    finished; both are counted (pipeline/cancelled_groups, pipeline/dropped_groups)."""

    monitor: MonitorConfig = MonitorConfig()
    """Weights & Biases and Prometheus (config/monitor.py). Under `slipstream rl` set once at the top level."""

    router_replay: bool = False
    """Router replay for MoE models (R3): every completion must come with the experts inference routed its tokens
    to (vLLM started with inference.enable_return_routed_experts, a GPU build), which travel with the batch so the
    trainer's MoE layers use them instead of their own top-k (tokens without routing keep the trainer's own).
    vLLM 0.32 returns routed experts in whole chat replies only, not in streamed ones, so these requests are not
    streamed and every token is stamped with the policy version served when its request was sent (the oldest it can
    be: staleness is judged early, never late). Single-turn environments only: multi-turn samples are trained with
    the trainer's routing."""

    concurrency: ConcurrencyConfig = ConcurrencyConfig()
    """In-flight limit of rollout completions (fixed or adaptive)."""

    weights_poll_s: float = Field(0.1, gt=0.0)
    """Seconds between two looks for newly published weights (loaded as soon as they appear, mid-rollout)."""

    micro_batch_tokens: int = Field(8192, ge=16)
    """Token budget of one packed training micro-batch."""

    shared_prefix: bool = True
    """Train the samples of a rollout group that begin with the same prompt as one prefix tree: the prompt once,
    each completion attending to it (models/common/prefix_tree.py). Exact: only tokens without loss in every sample
    are shared, so loss and gradients are those of the samples one by one, with fewer tokens to compute. False:
    every sample packed with its own copy of the prompt. A CUDA trainer writes trees back out as their samples
    (exact, no speedup) until a fused kernel for tree masks (flex_attention) lands; the CPU trainer and context
    parallelism run them as trees."""

    shared_prefix_min_tokens: int = Field(2, ge=1)
    """Shortest prompt prefix worth sharing (shared_prefix)."""

    num_trainer_ranks: int = Field(1, ge=1)
    """Number of trainer ranks; each gets its own list of micro-batches."""

    sampling: SamplingConfig = SamplingConfig()
    env: EnvConfig = EnvConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    weight_check: WeightCheckConfig = WeightCheckConfig()

    eval: OnlineEvalConfig = OnlineEvalConfig()
    """Online evaluation on held-out tasks during training (off unless `eval.interval` > 0)."""

    request_timeout_s: float = Field(600.0, gt=0.0)
    """Timeout of one inference request (for multi-turn environments: of one model turn)."""

    rollout_timeout_s: float | None = Field(None, gt=0.0)
    """Multi-turn environments: wall-clock budget of one rollout (model turns and environment work); a rollout
    that exceeds it fails (counted, excluded from training). None: the environment's own budget."""

    weights_timeout_s: float = Field(3600.0, gt=0.0)
    """How long to wait for the trainer to publish the weights a step needs."""

    health_timeout_s: float = Field(600.0, gt=0.0)
    """How long to wait for the inference server to become healthy."""

    recovery: RecoveryConfig = RecoveryConfig()
    """Waiting for inference and re-establishing its weights when it is lost mid-run."""

    colocate: ColocateConfig | None = None
    """Set (by `slipstream rl`, from deployment.colocate): inference and the trainer share the GPU and take turns;
    after each batch the orchestrator waits for the requests in flight, puts vLLM to sleep and writes the batch, and
    wakes vLLM to load the trainer's next version. Batch n then always waits for policy n - 1: max_async_level only
    lets groups of later batches start in the same turn (data up to that many steps old), and spare_batches is
    ignored (a turn waits for every group in flight anyway). None: they run side by side."""

    @property
    def weight_check_tolerance(self) -> float:
        """The weight check's max |diff|, defaulted by the model dtype."""
        if self.weight_check.max_abs_diff is not None:
            return self.weight_check.max_abs_diff
        return 1e-3 if self.model.dtype == "float32" else 5e-2

    @model_validator(mode="after")
    def _check_staleness(self) -> "OrchestratorConfig":
        if self.max_off_policy_steps < self.max_async_level:
            raise ValueError(
                f"max_off_policy_steps ({self.max_off_policy_steps}) is below max_async_level "
                f"({self.max_async_level}), so rollouts of the oldest policy a batch may use would be dropped; "
                f"raise orchestrator.max_off_policy_steps to at least {self.max_async_level}"
            )
        return self

    @model_validator(mode="after")
    def _check_no_stall(self) -> "OrchestratorConfig":
        self.weights.check_no_stall_lora(self.model.lora is not None)
        return self

    @model_validator(mode="after")
    def _check_group(self) -> "OrchestratorConfig":
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size}); "
                f"change orchestrator.batch_size to {self.batch_size // self.group_size * self.group_size or self.group_size}"
            )
        return self
