"""`slipstream sft` with [slurm], without a cluster: the job script and the per-node script (torchrun with a static
rendezvous on the job's first node) pass `bash -n` and shellcheck and match golden files; the node config loads
back with absolute paths and without [slurm]; `--dry-run` prints the sbatch command; mistakes name the field. (The
per-node script training for real as two nodes of one machine: tests/e2e/test_slurm.py.)"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from slipstream.config.base import ConfigError
from slipstream.config.loader import load_config
from slipstream.config.sft import SFTConfig
from slipstream.launch.slurm_sft import render_sft_job

GOLDEN = Path(__file__).parent / "golden" / "slurm" / "sft_two_node"
UPDATE_ENV = "SLIPSTREAM_UPDATE_GOLDEN"


def sft_config(tmp_path: Path, model: str = "org/tiny-model", **sections) -> dict:
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    config = {
        "model": {"name": model},
        "data": {"train_files": ["train.jsonl"]},
        "output_dir": str(tmp_path / "run"),
        "max_steps": 2,
        "batch_size": 2,
        "micro_batch_tokens": 64,
        "slurm": {"num_nodes": 2, "partition": "gpu", "gpus_per_node": 8, "python": "/opt/venv/bin/python"},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def _load(tmp_path: Path, config: dict, *overrides: str) -> SFTConfig:
    path = tmp_path / "sft.toml"
    path.write_text(tomli_w.dumps(config))
    return load_config(SFTConfig, ["-c", str(path), *overrides])


def test_rendered_sft_scripts_pass_bash_n_shellcheck_and_match_golden(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # train.jsonl is relative: the node config holds it absolute
    files = render_sft_job(_load(tmp_path, sft_config(tmp_path)))
    shellcheck = shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck is not installed: `make setup` installs it as root"
    for script in (files.job_script, files.node_script):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
        check = subprocess.run([shellcheck, "-s", "bash", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, f"{script.name}:\n{check.stdout}"
    rendered = {p.name: p.read_text().replace(str(tmp_path), "/TMP") for p in (files.job_script, files.node_script)}
    if os.environ.get(UPDATE_ENV) == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, text in rendered.items():
            (GOLDEN / name).write_text(text)
    for name, text in rendered.items():
        assert text == (GOLDEN / name).read_text(), (
            f"sft_two_node/{name} differs from golden; {UPDATE_ENV}=1 rewrites it"
        )
    node = load_config(SFTConfig, ["-c", str(files.node_configs["sft"])])
    assert node.slurm is None and not node.dry_run and node.output_dir == tmp_path / "run"
    assert node.data.train_files == [tmp_path / "train.jsonl"]
    assert "--nnodes 2" in rendered["node.sh"] and "--nproc-per-node 8" in rendered["node.sh"]


def test_sft_dry_run_prints_the_sbatch_command_and_submits_nothing(tmp_path):
    path = tmp_path / "sft.toml"
    path.write_text(tomli_w.dumps(sft_config(tmp_path)))
    env = {**os.environ, "PATH": str(tmp_path / "no-slurm-here")}
    cmd = [sys.executable, "-m", "slipstream", "sft", "-c", str(path), "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"sbatch --parsable {tmp_path / 'run' / 'slurm' / 'job.sbatch'}"
    proc = subprocess.run(cmd[:-1], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr


def test_sft_slurm_mistakes_name_the_field(tmp_path):
    config = sft_config(tmp_path)
    config["slurm"]["trainer_nodes"] = 1
    with pytest.raises(ConfigError, match=r"slurm.trainer_nodes places an RL run's trainer"):
        _load(tmp_path, config)
    config = sft_config(tmp_path)
    del config["slurm"]
    with pytest.raises(ConfigError, match=r"--dry-run only applies to a Slurm submission"):
        _load(tmp_path, config, "--dry-run")
