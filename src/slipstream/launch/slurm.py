"""`slipstream rl` with `[slurm]`: render the job script and the per-node script from Jinja templates, write them
with each node's config into `<output_dir>/slurm/`, and submit the job with sbatch.

Every node of the job runs `slipstream rl` on its share of the run (deployment.run), so everything the local
launcher does (placement, supervision, inference restarts, killing every child when it dies, the run lock, resume)
also holds on each node. Layouts: one node runs all three processes in the run directory; with N >= 2 nodes, nodes 0 .. N-2
run the inference deployment (node k in its own directory `slurm/nodes/inference_<k>/`: its lock, config and logs;
rank k of inference.deployment.nodes, which the job fills with the hostnames Slurm gives them; the router, or the
wide-EP head, on node 0) and the last slurm.trainer_nodes nodes run the trainer (torchrun across them, rendezvous on
the first) and, beside its first rank, the orchestrator, in the run directory, reaching inference (and each engine,
for admin calls) by those hostnames.
"""

import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from slipstream.config.rl import SLURM_NODE_PLACEHOLDER, RLConfig
from slipstream.config.slurm import SlurmConfig

TEMPLATES = Path(__file__).parent / "templates"
JOB_TEMPLATE = TEMPLATES / "slurm_job.sh.jinja"
NODE_TEMPLATE = TEMPLATES / "slurm_node.sh.jinja"


@dataclass(frozen=True)
class NodeRole:
    """What one node of the job runs: `name` (all | inference | trainer), the directory its `slipstream rl` owns and
    the config it runs."""

    name: str
    node_dir: Path
    config: Path


@dataclass(frozen=True)
class SlurmFiles:
    """What render_job wrote: the job script, the per-node script and each node's config."""

    job_script: Path
    node_script: Path
    node_configs: dict[str, Path]
    logs_dir: Path


def slurm_dir(config: RLConfig) -> Path:
    return Path(config.output_dir).resolve() / "slurm"


def node_configs(config: RLConfig) -> dict[str, RLConfig]:
    """role -> the config of the node with that role, in node order: [slurm] removed, output_dir absolute,
    deployment.run set. With several nodes, the first num_nodes - trainer_nodes run inference (role `inference`, or
    `inference_<k>` with several), each in its own directory, listening on every interface, as rank k of the
    inference deployment; the last trainer_nodes run the trainer (`trainer`, with the orchestrator, then
    `trainer_<r>`: launch.trainer_node_rank r) in the run directory. inference.deployment.nodes holds placeholders
    (`slurm-node-<k>`): each node's script passes the job's hostnames instead."""
    slurm = config.slurm
    assert slurm is not None
    root = Path(config.output_dir).resolve()
    common: dict[str, Any] = {"output_dir": str(root), "slurm": None, "dry_run": False}
    if slurm.num_nodes == 1:
        return {"all": config.rebuilt(common)}
    num_inference = slurm.num_inference_nodes
    nodes = [f"{SLURM_NODE_PLACEHOLDER}{k}" for k in range(num_inference)]
    configs = {}
    for k in range(num_inference):
        deployment = {"nodes": nodes, "node_rank": k}
        configs[inference_role(k, num_inference)] = config.rebuilt(
            {
                **common,
                "output_dir": str(inference_node_dir(config, k)),
                "deployment": {"run": ["inference"]},
                "inference": {"host": "0.0.0.0", "deployment": deployment},
            }
        )
    for r in range(slurm.trainer_nodes):
        run = ["trainer", "orchestrator"] if r == 0 else ["trainer"]
        launch = {"trainer_nodes": slurm.trainer_nodes, "trainer_node_rank": r}
        changes = {"deployment": {"run": run}, "inference": {"deployment": {"nodes": nodes}}, "launch": launch}
        configs["trainer" if r == 0 else f"trainer_{r}"] = config.rebuilt({**common, **changes})
    return configs


def inference_role(k: int, num_inference: int) -> str:
    return "inference" if num_inference == 1 else f"inference_{k}"


def inference_node_dir(config: RLConfig, k: int = 0) -> Path:
    return slurm_dir(config) / "nodes" / f"inference_{k}"


def render_job(config: RLConfig) -> SlurmFiles:
    """Write `slurm/job.sbatch`, `slurm/node.sh` and `slurm/node_<role>.toml` for `config`; return their paths.
    Raises ConfigError (a ValueError) naming the field when a node's config or a template is invalid."""
    slurm = config.slurm
    assert slurm is not None
    folder = slurm_dir(config)
    configs = node_configs(config)
    logs_dir = folder / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    roles = []
    for role, node_config in configs.items():
        path = folder / f"node_{role}.toml"
        path.write_text(tomli_w.dumps(node_config.user_toml_dict()))
        node_dir = Path(node_config.output_dir)
        node_dir.mkdir(parents=True, exist_ok=True)
        roles.append(NodeRole(role, node_dir, path))
    variables = template_variables(config, slurm, roles, folder)
    job_script, node_script = folder / "job.sbatch", folder / "node.sh"
    node_script.write_text(render(slurm.node_template or NODE_TEMPLATE, variables))
    job_script.write_text(render(slurm.job_template or JOB_TEMPLATE, {**variables, "node_script": str(node_script)}))
    for script in (job_script, node_script):
        script.chmod(0o755)
    return SlurmFiles(job_script, node_script, {r.name: r.config for r in roles}, logs_dir)


def template_variables(config: RLConfig, slurm: SlurmConfig, roles: list[NodeRole], folder: Path) -> dict[str, Any]:
    """The variables both templates see (listed at the top of each default template)."""
    return {
        **slurm.model_dump(exclude={"job_template", "node_template", "python", "wait"}),
        "python": slurm.python or sys.executable,
        "run_dir": str(Path(config.output_dir).resolve()),
        "slurm_dir": str(folder),
        "logs_dir": str(folder / "logs"),
        "command": "rl",
        "inference_port": config.inference.port,
        "num_inference_nodes": slurm.num_inference_nodes,
        "collective_weights": config.weights.transport in ("nccl", "gloo"),
        "roles": [{"name": r.name, "node_dir": str(r.node_dir), "config": str(r.config)} for r in roles],
    }


def render(template: Path, variables: dict[str, Any]) -> str:
    """Render a Jinja template file; undefined variables are errors (a custom template's typo must not vanish).
    Comments are `{## ... ##}` (bash's `${#array[@]}` contains Jinja's usual `{#`)."""
    import jinja2

    from slipstream.config.base import ConfigError

    path = Path(template).expanduser()
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(path.parent), str(TEMPLATES)]),  # custom templates include ours too
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # shell scripts, not HTML: values are quoted with the `q` filter instead
        comment_start_string="{##",  # `{#` starts bash's `${#array[@]}`
        comment_end_string="##}",
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    try:
        return env.get_template(path.name).render(**variables)
    except jinja2.TemplateError as e:
        raise ConfigError(f"cannot render the Slurm template {path}: {e}") from None


def submit_rl(config: RLConfig) -> int:
    """Render and write the job, then submit it (or with --dry-run print the sbatch command); return the exit code
    (with slurm.wait: the job's)."""
    assert config.slurm is not None
    return submit(lambda: render_job(config), config.slurm, config.dry_run)


def submit(render_files: Callable[[], SlurmFiles], slurm: SlurmConfig, dry_run: bool) -> int:
    """Write the job's files (`render_files`), then sbatch it, or with `dry_run` print the sbatch command."""
    from slipstream.config.base import ConfigError

    try:
        files = render_files()
    except ConfigError as e:
        for line in str(e).splitlines():
            _say(f"error: {line}", err=True)
        return 2
    command = ["sbatch", "--parsable", *(["--wait"] if slurm.wait else []), str(files.job_script)]
    _say(
        f"wrote {files.job_script}, {files.node_script.name} and {', '.join(p.name for p in files.node_configs.values())}"
    )
    if dry_run:
        print(shlex.join(command), flush=True)
        return 0
    if shutil.which("sbatch") is None:
        _say(
            "error: sbatch is not on PATH: [slurm] submits the run with Slurm; run this on a Slurm login node, or "
            "add --dry-run to only write the job script",
            err=True,
        )
        return 2
    return _sbatch(command, files, slurm.wait)


def _sbatch(command: list[str], files: SlurmFiles, wait: bool) -> int:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()  # --parsable: "<job id>[;cluster]", printed as soon as it is queued
    job_id = first.split(";", 1)[0]
    if job_id.isdigit():
        _say(
            f"submitted job {job_id}; logs: {files.logs_dir}/job_{job_id}*.log; stop it with `scancel {job_id}`; "
            "continue it in a new job with the same command plus --resume"
        )
    out, err = proc.communicate()
    if proc.returncode != 0 and not job_id.isdigit():
        _say(f"error: sbatch failed (exit {proc.returncode}): {(first + out + err).strip()}", err=True)
        return 1
    if wait:
        _say(f"job {job_id} ended with exit code {proc.returncode}")
    return proc.returncode


def _say(message: str, err: bool = False) -> None:
    print(f"[slipstream] {message}", file=sys.stderr if err else sys.stdout, flush=True)
