"""`slipstream sft` with `[slurm]`: the fine-tuning as one Slurm job, torchrun on every node of it (a static
rendezvous on the first node), from the same job template as RL (launch/slurm.py) and its own per-node template.
Resume across jobs: submit again with `--resume_step latest`."""

import sys
from pathlib import Path

from slipstream.config.sft import SFTConfig
from slipstream.launch.slurm import JOB_TEMPLATE, TEMPLATES, SlurmFiles, render, submit

SFT_NODE_TEMPLATE = TEMPLATES / "slurm_sft_node.sh.jinja"


def submit_sft(config: SFTConfig) -> int:
    """Render and write the job, then submit it (or with --dry-run print the sbatch command); the exit code (with
    slurm.wait: the job's)."""
    assert config.slurm is not None
    return submit(lambda: render_sft_job(config), config.slurm, config.dry_run)


def render_sft_job(config: SFTConfig) -> SlurmFiles:
    """Write `<output_dir>/slurm/{job.sbatch, node.sh, node_sft.toml}`; ConfigError (a ValueError) naming the
    template when one cannot be rendered."""
    slurm = config.slurm
    assert slurm is not None
    root = Path(config.output_dir).resolve()
    folder = root / "slurm"
    logs_dir = folder / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    node_config = folder / "node_sft.toml"
    model = config.model
    if Path(model.name).exists():  # a local folder: the nodes may start elsewhere
        model = model.model_copy(update={"name": str(Path(model.name).resolve())})
    update = {"slurm": None, "dry_run": False, "output_dir": root, "data": _absolute_data(config), "model": model}
    node = config.model_copy(update=update)
    node.write_toml(node_config)
    variables = {
        **slurm.model_dump(exclude={"job_template", "node_template", "python", "wait", "trainer_nodes"}),
        "command": "sft",
        "python": slurm.python or sys.executable,
        "run_dir": str(root),
        "slurm_dir": str(folder),
        "logs_dir": str(logs_dir),
        "config": str(node_config),
        "procs_per_node": slurm.gpus_per_node or 1,
        "master_port": config.master_port,
    }
    job_script, node_script = folder / "job.sbatch", folder / "node.sh"
    node_script.write_text(render(slurm.node_template or SFT_NODE_TEMPLATE, variables))
    job_script.write_text(render(slurm.job_template or JOB_TEMPLATE, {**variables, "node_script": str(node_script)}))
    for script in (job_script, node_script):
        script.chmod(0o755)
    return SlurmFiles(job_script, node_script, {"sft": node_config}, logs_dir)


def _absolute_data(config: SFTConfig):
    """The data files as absolute paths (the nodes' working directory need not be this one)."""
    data = config.data
    return data.model_copy(
        update={
            "train_files": [p.resolve() for p in data.train_files],
            "val_files": [p.resolve() for p in data.val_files],
        }
    )
