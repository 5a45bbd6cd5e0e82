"""Config of `[slurm]`: `slipstream rl` submits the run as one Slurm batch job instead of running it here."""

import datetime
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import BaseConfig


class SlurmConfig(BaseConfig):
    """Submit the run to Slurm: `slipstream rl` renders `<output_dir>/slurm/job.sbatch` (the job) and
    `<output_dir>/slurm/node.sh` (what each node runs) from Jinja templates, writes each node's config beside them
    and runs `sbatch` (`--dry-run`: only writes them and prints the sbatch command). The run directory must be on a
    filesystem every node of the job sees.

    Layouts: one node runs inference, orchestrator and trainer (`num_nodes = 1`); with more, the first
    num_nodes - trainer_nodes run inference and the last trainer_nodes the trainer (the orchestrator beside its
    first rank), weights travelling by `weights.transport`."""

    num_nodes: int = Field(1, ge=1)
    """Nodes of the job. 1: everything on one node. N >= 2: inference on the first N - trainer_nodes nodes (the
    inference deployment's nodes, whose hostnames the job fills into inference.deployment.nodes: with more than one
    set inference.deployment.kind to 'multi_node' or 'disaggregated'), trainer and orchestrator on the last ones
    (set weights.transport: 'filesystem' through the shared run directory, or 'nccl' between GPU nodes)."""

    trainer_nodes: int = Field(1, ge=1)
    """Nodes of the job for the trainer, the last ones (torchrun across them: launch.trainer_nodes); the first of
    them also runs the orchestrator. The inference deployment gets the other num_nodes - trainer_nodes nodes."""

    job_name: str = Field("slipstream", min_length=1)
    """Slurm job name (`squeue` shows it)."""

    partition: str | None = None
    """Partition to submit to (`#SBATCH --partition`); None: the cluster's default."""

    account: str | None = None
    """Account charged for the job (`#SBATCH --account`); None: the user's default."""

    time_limit: str | None = Field(None, min_length=1)
    """Wall-clock limit in a Slurm time format such as `2-00:00:00` or `12:00:00` (`#SBATCH --time`); None: the
    partition's default. A run stopped by it continues with `slipstream rl --resume` in a new job."""

    gpus_per_node: int | None = Field(None, ge=0)
    """GPUs requested on each node (`#SBATCH --gpus-per-node`); None: request none explicitly (CPU nodes, or
    clusters that give whole nodes). Each node's `slipstream rl` uses the GPUs Slurm makes visible."""

    cpus_per_node: int | None = Field(None, ge=1)
    """CPUs requested on each node (`#SBATCH --cpus-per-task`, one task per node); None: the cluster's default."""

    mem: str | None = Field(None, min_length=1)
    """Memory per node (`#SBATCH --mem`): a size such as `200G` (a bare number is megabytes, Slurm's unit), or `0`
    for all of each node's memory; None: the cluster's default."""

    exclusive: bool = False
    """Ask for whole nodes (`#SBATCH --exclusive`)."""

    sbatch_args: list[str] = []
    """More sbatch options, one per `#SBATCH` line, e.g. `["--qos=high", "--constraint=h100"]`."""

    setup: list[str] = []
    """Shell lines run on every node before `slipstream rl` starts, e.g. `["module load cuda/12.4"]`."""

    env: dict[str, str] = {}
    """Environment variables exported on every node (e.g. `HF_HOME`, `NCCL_SOCKET_IFNAME`)."""

    python: str | None = None
    """Python interpreter that runs Slipstream on the nodes; None: the one running this `slipstream rl` (its
    virtual environment must then be on a filesystem the nodes see)."""

    grace_s: float = Field(120.0, ge=0.0)
    """When one node's part of a multi-node job ends (a failure, or inference dying), how long the other nodes get
    to finish what they are doing (a checkpoint being written) before their `slipstream rl` is stopped."""

    wait: bool = False
    """Wait for the job to end and return its exit code (`sbatch --wait`) instead of returning once it is queued."""

    job_template: Path | None = None
    """Custom Jinja template of the job script; None: slipstream/launch/templates/slurm_job.sh.jinja (start from a
    copy of it: the variables it uses are listed at its top)."""

    node_template: Path | None = None
    """Custom Jinja template of the per-node script; None: slipstream/launch/templates/slurm_node.sh.jinja."""

    @field_validator("time_limit", "mem", mode="before")
    @classmethod
    def _as_text(cls, value: Any) -> Any:
        """What TOML reads as an integer (`mem = 0`) or a time (`time_limit = 12:00:00`) is the text written."""
        if isinstance(value, int | datetime.time) and not isinstance(value, bool):
            return str(value)
        return value

    @property
    def num_inference_nodes(self) -> int:
        """Nodes of the inference deployment: all but the trainer's, or the one node of a one-node job."""
        return max(self.num_nodes - self.trainer_nodes, 1)

    @model_validator(mode="after")
    def _check_layout(self) -> "SlurmConfig":
        if self.num_nodes == 1 and self.trainer_nodes > 1:
            raise ValueError(
                f"slurm.trainer_nodes = {self.trainer_nodes} needs a job of more nodes than slurm.num_nodes = 1 "
                "(inference takes at least one node of its own)"
            )
        if self.num_nodes > 1 and self.trainer_nodes >= self.num_nodes:
            raise ValueError(
                f"slurm.trainer_nodes ({self.trainer_nodes}) leaves no node for inference in a job of "
                f"slurm.num_nodes = {self.num_nodes}; raise num_nodes or lower trainer_nodes"
            )
        for name in ("job_template", "node_template"):
            path = getattr(self, name)
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"slurm.{name} = {str(path)!r} is not a file; give the path of a Jinja template")
        for line in self.sbatch_args:
            if not line.startswith("-") or "\n" in line:
                raise ValueError(
                    f"slurm.sbatch_args entry {line!r} is not one sbatch option; write e.g. '--qos=high' (one per entry)"
                )
        for key in self.env:
            if not key.isidentifier():
                raise ValueError(f"slurm.env key {key!r} is not a valid environment variable name")
        return self
