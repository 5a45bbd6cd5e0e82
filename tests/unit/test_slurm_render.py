"""[slurm] rendering without a cluster: `slipstream rl --dry-run` writes the job script, the per-node script and the
node configs; the scripts pass `bash -n` and shellcheck and match golden files (the node configs, full dumps of every
default, are checked by loading them back instead); config mistakes fail with the field named. (A real Slurm runs
the scripts in tests/e2e/test_slurm.py.)"""

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from slipstream.config.base import ConfigError
from slipstream.config.loader import load_config
from slipstream.config.rl import RLConfig
from slipstream.launch.slurm import render_job

GOLDEN = Path(__file__).parent / "golden" / "slurm"
UPDATE_ENV = "SLIPSTREAM_UPDATE_GOLDEN"
"""Set to 1 to rewrite the golden files from the current templates (then review the diff)."""

LAYOUTS = {
    "one_node": {"slurm": {"partition": "debug", "time_limit": "04:00:00", "gpus_per_node": 8}},
    "two_node_gloo": {
        "weights": {"transport": "gloo"},
        "slurm": {
            "num_nodes": 2,
            "account": "rl",
            "sbatch_args": ["--qos=high"],
            "setup": ["module load cuda"],
            "env": {"HF_HOME": "/shared/hf cache"},
        },
    },
    "two_node_filesystem": {"weights": {"transport": "filesystem"}, "slurm": {"num_nodes": 2, "exclusive": True}},
    # three nodes: two for the inference deployment (replicas, wide-EP or prefill/decode), the last for the trainer
    "three_node_replicas": {
        "weights": {"transport": "nccl"},
        "slurm": {"num_nodes": 3, "gpus_per_node": 8},
        "inference": {"tensor_parallel_size": 4, "deployment": {"kind": "multi_node", "num_replicas": 2}},
    },
    "three_node_wide_ep": {
        "weights": {"transport": "nccl"},
        "slurm": {"num_nodes": 3, "gpus_per_node": 8},
        "inference": {"enable_expert_parallel": True, "data_parallel_size": 8, "deployment": {"kind": "multi_node"}},
    },
    "three_node_pd": {
        "weights": {"transport": "nccl"},
        "slurm": {"num_nodes": 3, "gpus_per_node": 8},
        "inference": {
            "tensor_parallel_size": 8,
            "deployment": {"kind": "disaggregated", "prefill": {"nodes": [0]}, "decode": {"nodes": [1]}},
        },
    },
}
SAME_SCRIPTS_AS = {"three_node_wide_ep": "three_node_replicas", "three_node_pd": "three_node_replicas"}
"""Layouts whose job and node scripts are another layout's golden files (only their layout.txt differs)."""
NODE_ROLES = {1: ["all"], 2: ["inference", "trainer"], 3: ["inference_0", "inference_1", "trainer"]}


def _config(tmp_path: Path, **sections) -> dict:
    config = {
        "max_steps": 3,
        "output_dir": str(tmp_path / "run"),
        "model": {"name": "org/tiny-model"},
        "inference": {"port": 8123},
        "orchestrator": {"env": {"name": "reverse_text"}},
        "trainer": {},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    config.setdefault("slurm", {}).setdefault("python", "/opt/venv/bin/python")
    return config


def _load(tmp_path: Path, config: dict, *overrides: str) -> RLConfig:
    path = tmp_path / "rl.toml"
    path.write_text(tomli_w.dumps(config))
    return load_config(RLConfig, ["-c", str(path), *overrides])


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None and os.geteuid() != 0:
        pytest.skip(f"{tool} is not installed and this is not root (`make setup` as root installs it)")
    assert path is not None, f"{tool} is not installed: `make setup` installs it as root, or `apt-get install {tool}`"
    return path


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rendered_scripts_pass_bash_n_shellcheck_and_match_golden(layout, tmp_path):
    files = render_job(_load(tmp_path, _config(tmp_path, **LAYOUTS[layout])))
    shellcheck = _need("shellcheck")
    for script in (files.job_script, files.node_script):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
        check = subprocess.run([shellcheck, "-s", "bash", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, f"{script.name}:\n{check.stdout}"
    rendered = {p.name: p.read_text().replace(str(tmp_path), "/TMP") for p in (files.job_script, files.node_script)}
    if len(files.node_configs) > 1:  # what each node runs: the layout's difference lives in the node configs
        gpus = LAYOUTS[layout]["slurm"].get("gpus_per_node") or 0
        rendered["layout.txt"] = _layout(files.node_configs, gpus).replace(str(tmp_path), "/TMP")
    assert list(files.node_configs) == NODE_ROLES[LAYOUTS[layout]["slurm"].get("num_nodes", 1)]
    folder = GOLDEN / layout
    if layout in SAME_SCRIPTS_AS:  # the layout lives in the node configs: the scripts are another layout's
        for name in ("job.sbatch", "node.sh"):
            shared = GOLDEN / SAME_SCRIPTS_AS[layout] / name
            assert rendered.pop(name) == shared.read_text(), f"{layout}/{name} differs from {shared}"
    if os.environ.get(UPDATE_ENV) == "1":
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in rendered.items():
            (folder / name).write_text(text)
    assert sorted(p.name for p in folder.iterdir()) == sorted(rendered), f"set {UPDATE_ENV}=1 to rewrite them"
    for name, text in rendered.items():
        assert text == (folder / name).read_text(), f"{layout}/{name} differs from golden; {UPDATE_ENV}=1 rewrites it"


def _layout(node_configs: dict[str, Path], gpus_per_node: int) -> str:
    """Per node: its processes, and on inference nodes every engine's and the router's environment and command line,
    as the node places and renders them on its GPUs, with the hostnames `slurm-node-<k>` its script would fill in."""
    from slipstream.inference.deployment import engine_commands, router_argv
    from slipstream.launch.plan import resolve_config

    lines = []
    for role, path in node_configs.items():
        config = resolve_config(load_config(RLConfig, ["-c", str(path)]), list(range(gpus_per_node)))
        launch = config.launch
        trainer = (
            f", trainer node {launch.trainer_node_rank} of {launch.trainer_nodes}" if role.startswith("trainer") else ""
        )
        lines.append(f"[{role}] run = {config.deployment.run}{trainer}")
        if "inference" not in config.deployment.run:
            continue
        inference, rank = config.inference, config.inference.deployment.node_rank
        for command in engine_commands(inference, Path("/models/m"), rank, on_gpu=gpus_per_node > 0):
            env = [f"{k}={v}" for k, v in sorted(command.env.items())]
            argv = ["python", *command.argv[1:]]
            lines.append("  " + " ".join([f"engine {command.slot.role} ({command.num_gpus} GPUs):", *env, *argv]))
        if rank == 0 and (router := router_argv(inference)) is not None:
            lines.append("  " + " ".join(["router:", "vllm-router", *router[1:]]))
    return "\n".join(lines) + "\n"


def test_node_configs_load_back_with_the_node_overrides(tmp_path):
    config = _load(tmp_path, _config(tmp_path, **LAYOUTS["two_node_gloo"]), "--resume")
    files = render_job(config)
    overrides = ["--orchestrator.inference_url", "http://node-a:8123", "--weights.master_addr", "node-b"]
    inference = load_config(RLConfig, ["-c", str(files.node_configs["inference"]), *overrides])
    trainer = load_config(RLConfig, ["-c", str(files.node_configs["trainer"]), *overrides])
    assert inference.deployment.run == ["inference"] and inference.inference.host == "0.0.0.0"
    assert inference.output_dir == tmp_path / "run" / "slurm" / "nodes" / "inference_0"
    assert trainer.deployment.run == ["trainer", "orchestrator"] and trainer.output_dir == tmp_path / "run"
    assert (
        trainer.orchestrator.inference_url == "http://node-a:8123" and trainer.trainer.weights.master_addr == "node-b"
    )
    assert trainer.resume and trainer.trainer.resume_step == "latest"
    assert inference.slurm is None and trainer.slurm is None
    raw = tomllib.loads(files.node_configs["trainer"].read_text())
    assert "slurm" not in raw and "weights" not in raw["trainer"]


def test_time_limit_and_all_memory_from_the_command_line_reach_sbatch(tmp_path):
    """`--slurm.time_limit 12:00:00` (a TOML time) and `--slurm.mem 0` (all of each node's memory, a TOML integer)
    are the text typed, and `mem = 0` is not dropped as a false value."""
    config = _load(tmp_path, _config(tmp_path), "--slurm.time_limit", "12:00:00", "--slurm.mem", "0")
    lines = render_job(config).job_script.read_text().splitlines()
    assert "#SBATCH --time=12:00:00" in lines and "#SBATCH --mem=0" in lines


def test_dry_run_prints_the_sbatch_command_and_submits_nothing(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text(tomli_w.dumps(_config(tmp_path, slurm={"wait": True})))
    env = {**os.environ, "PATH": str(tmp_path / "no-slurm-here")}  # an sbatch call would fail: none is found
    cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(path), "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "run" / "slurm" / "job.sbatch"
    assert proc.stdout.strip().splitlines()[-1] == f"sbatch --parsable --wait {script}"
    assert script.is_file() and (tmp_path / "run" / "slurm" / "node_all.toml").is_file()
    proc = subprocess.run(cmd[:-1], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr and "--dry-run" in proc.stderr


def test_custom_templates_render_with_the_same_variables(tmp_path):
    job = tmp_path / "job.jinja"
    job.write_text("#!/bin/bash\n#SBATCH --nodes={{ num_nodes }}\n# {{ roles | map(attribute='name') | join(',') }}\n")
    node = tmp_path / "node.jinja"
    node.write_text("#!/bin/bash\n{{ python | q }} -m slipstream rl -c {{ roles[0].config | q }}\n")
    config = _config(tmp_path, weights={"transport": "filesystem"})
    config["slurm"] |= {"num_nodes": 2, "job_template": str(job), "node_template": str(node)}
    files = render_job(_load(tmp_path, config))
    assert files.job_script.read_text() == "#!/bin/bash\n#SBATCH --nodes=2\n# inference,trainer\n"
    assert "/opt/venv/bin/python -m slipstream rl -c" in files.node_script.read_text()
    node.write_text("{{ no_such_variable }}")
    with pytest.raises(ConfigError, match="no_such_variable"):
        render_job(_load(tmp_path, config))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"slurm": {"num_nodes": 3}, "weights": {"transport": "filesystem"}},
            r"slurm.num_nodes = 3 gives inference 2 nodes .* inference.deployment.kind = 'single_node' runs on one",
        ),
        (
            {
                "slurm": {"num_nodes": 3},
                "weights": {"transport": "filesystem"},
                "inference": {"deployment": {"kind": "multi_node", "nodes": ["a"]}},
            },
            r"inference.deployment.nodes lists 1 node\(s\), but the Slurm job has 2 inference node\(s\)",
        ),
        ({"slurm": {"num_nodes": 2}}, r"set weights.transport"),
        ({"deployment": {"run": ["inference"]}, "weights": {"transport": "filesystem"}}, r"remove deployment.run"),
        ({"slurm": {"num_nodes": 2, "trainer_nodes": 2}}, r"slurm.trainer_nodes \(2\) leaves no node for inference"),
        ({"slurm": {"trainer_nodes": 2}}, r"slurm.trainer_nodes = 2 needs a job of more nodes"),
        ({"launch": {"trainer_nodes": 2}}, r"launch.trainer_nodes is set for each node by \[slurm\]"),
        ({"slurm": {"sbatch_args": ["qos=high"]}}, r"slurm.sbatch_args entry 'qos=high'"),
        ({"slurm": {"job_template": "/no/such/file.jinja"}}, r"slurm.job_template .* is not a file"),
        ({"slurm": {"env": {"A-B": "1"}}}, r"slurm.env key 'A-B'"),
    ],
)
def test_config_mistakes_name_the_field(sections, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, _config(tmp_path, **sections))


def test_dry_run_without_slurm_is_an_error(tmp_path):
    config = _config(tmp_path)
    del config["slurm"]
    with pytest.raises(ConfigError, match="--dry-run only applies to a Slurm submission"):
        _load(tmp_path, config, "--dry-run")


FAKE_PYTHON = """#!/bin/bash
# stands in for `python -m slipstream ...`: the cleanup exits at once, `rl` runs until SIGTERM (exit 130)
[[ "$2" == slipstream.launch.stale ]] && exit 0
trap 'echo "stopped after $SECONDS s"; exit 130' TERM
while true; do sleep 0.1; done
"""


@pytest.mark.parametrize(
    ("role", "node_id", "peer", "waits"), [("trainer", 1, "inference", 2), ("inference", 0, "trainer", 0)]
)
def test_node_script_stops_when_the_other_node_ends_after_the_grace_period(role, node_id, peer, waits, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("scontrol", "#!/bin/bash\nprintf 'node-a\\nnode-b\\n'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    config = _config(tmp_path, weights={"transport": "filesystem"})
    config["slurm"] |= {"num_nodes": 2, "grace_s": 2, "python": str(bin_dir / "python")}
    files = render_job(_load(tmp_path, config))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_NODEID": str(node_id)}
    env |= {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]"}
    node = subprocess.Popen(["bash", str(files.node_script)], env=env, stdout=subprocess.PIPE, text=True)
    exits = files.node_script.parent / "job_7"
    time.sleep(1.5)
    assert node.poll() is None, "the node's part ended before the other node did"
    (exits / f"{peer}.exit").write_text("1\n")
    out, _ = node.communicate(timeout=30)
    stopped = float(re.search(r"stopped after (\d+) s", out).group(1))
    assert waits <= stopped - 1 <= waits + 2, out
    assert f"{peer} ended (exit 1); stopping {role}" in out
    assert (exits / f"{role}.exit").read_text().strip() == "130"
    # the inference node stopped on purpose leaves the job's exit code to the trainer's node
    assert node.returncode == (0 if role == "inference" else 130), out


RECORDING_PYTHON = """#!/bin/bash
# stands in for `python -m slipstream ...`: records the command line of `rl` (one argument per line) and exits
[[ "$2" == slipstream.launch.stale ]] && exit 0
printf '%s\\n' "$@" > "$RECORD"
"""


def test_each_node_of_a_three_node_job_runs_its_part_of_the_deployment(tmp_path):
    """node.sh of the three-node replicas layout, run as each node of a 3-node allocation (SLURM_* variables, a
    stand-in python that records what it is asked to run): each node starts `slipstream rl` on its own config with
    the job's hostnames; loaded with those arguments, the configs place engines, router, trainer and weight
    transfer on the right hosts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", RECORDING_PYTHON), ("scontrol", "#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\n'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    config = _config(tmp_path, **LAYOUTS["three_node_replicas"])
    config["slurm"]["python"] = str(bin_dir / "python")
    files = render_job(_load(tmp_path, config))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "3"}
    env["SLURM_JOB_NODELIST"] = "gpu-[a-c]"
    loaded = {}
    for node_id, role in enumerate(NODE_ROLES[3]):
        record = tmp_path / f"argv_{node_id}"
        node_env = {**env, "SLURM_NODEID": str(node_id), "RECORD": str(record)}
        proc = subprocess.run(
            ["bash", str(files.node_script)], env=node_env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"role {role}" in proc.stdout
        # the nodes run one after another here, not together: the exit code this node left would make the next
        # node's script stop its launcher at once (a peer ended), maybe before the stand-in recorded its arguments
        exit_file = tmp_path / "run" / "slurm" / "job_9" / f"{role}.exit"
        assert exit_file.read_text().strip() == "0"
        exit_file.unlink()
        argv = record.read_text().splitlines()
        assert argv[:4] == ["-m", "slipstream", "rl", "-c"] and argv[4] == str(files.node_configs[role])
        loaded[role] = load_config(RLConfig, argv[3:])
    engines = ["http://gpu-a:8124", "http://gpu-a:8125", "http://gpu-b:8124", "http://gpu-b:8125"]
    for k in (0, 1):
        inference = loaded[f"inference_{k}"]
        assert inference.deployment.run == ["inference"] and inference.inference.deployment.node_rank == k
        assert inference.inference.deployment.nodes == ["gpu-a", "gpu-b"] and inference.inference.host == "0.0.0.0"
        assert inference.output_dir == tmp_path / "run" / "slurm" / "nodes" / f"inference_{k}"
    trainer = loaded["trainer"]
    assert trainer.deployment.run == ["trainer", "orchestrator"] and trainer.output_dir == tmp_path / "run"
    assert trainer.orchestrator.inference_url == "http://gpu-a:8123"  # the router, on the first node
    assert trainer.orchestrator.inference_engine_urls == engines  # admin calls reach every engine on its host
    assert trainer.trainer.weights.master_addr == "gpu-c"
    from slipstream.launch.plan import resolve_config

    for config in loaded.values():  # model.dtype was left unset: each node decides it from its GPUs
        assert resolve_config(config, list(range(8))).model.dtype == "bfloat16"


def test_a_trainer_on_two_nodes_gets_one_role_per_node(tmp_path):
    """slurm.trainer_nodes = 2 in a 4-node job: two inference nodes, then the trainer's first node (with the
    orchestrator) and its second (trainer ranks only), each told its rank and the first trainer node's address."""
    config = _config(tmp_path, **LAYOUTS["three_node_replicas"])
    config["slurm"] |= {"num_nodes": 4, "trainer_nodes": 2}
    files = render_job(_load(tmp_path, config))
    assert list(files.node_configs) == ["inference_0", "inference_1", "trainer", "trainer_1"]
    overrides = ["--launch.trainer_master_addr", "gpu-c", "--weights.master_addr", "gpu-c"]
    overrides += [
        "--inference.deployment.nodes",
        '["gpu-a", "gpu-b"]',
        "--orchestrator.inference_url",
        "http://gpu-a:8123",
    ]
    first, second = (
        load_config(RLConfig, ["-c", str(files.node_configs[r]), *overrides]) for r in ("trainer", "trainer_1")
    )
    assert first.deployment.run == ["trainer", "orchestrator"] and second.deployment.run == ["trainer"]
    assert (first.launch.trainer_nodes, first.launch.trainer_node_rank) == (2, 0)
    assert (second.launch.trainer_nodes, second.launch.trainer_node_rank) == (2, 1)
    assert first.output_dir == second.output_dir == tmp_path / "run"
    assert second.launch.trainer_master_addr == "gpu-c"
    script = files.node_script.read_text()
    assert (
        "trainer_host=${hosts[2]}" in script and 'overrides+=(--launch.trainer_master_addr "$trainer_host")' in script
    )
