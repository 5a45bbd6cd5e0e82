"""`slipstream k8s render`: the manifests of every example config validate against the Kubernetes schemas
(kubernetes-validate, strict), pods get predictable names and their share of one node's GPUs, the admin token is a
Secret read through env, and the per-process configs in the ConfigMap load back and point at the right pods."""

import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from slipstream.cli import main as cli_main
from slipstream.config.base import ConfigError
from slipstream.config.inference import InferenceConfig
from slipstream.config.loader import load_config
from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.config.rl import RLConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.deploy.k8s import render_manifests, to_yaml

COLOCATED = {"reverse_text/rl-1gpu-smollm2.toml"}
"""Examples that share one GPU between vLLM and the trainer: one machine's job, not pods."""
EXAMPLES = sorted(
    p
    for p in (Path(__file__).parents[2] / "examples").glob("*/rl*.toml")
    if f"{p.parent.name}/{p.name}" not in COLOCATED
)
GPU_EXAMPLES = {"qwen3_30b_a3b/rl.toml": 8, "reverse_text/rl-gpu.toml": 2, "reverse_text/rl-gpu-smollm2.toml": 2}


def _example(path: Path, *overrides: str) -> RLConfig:
    key = f"{path.parent.name}/{path.name}"
    gpus = ["--kubernetes.gpus", str(GPU_EXAMPLES[key])] if key in GPU_EXAMPLES else []
    return load_config(RLConfig, ["-c", str(path), *gpus, *overrides])


def _by_kind(files: dict[str, list[dict]]) -> dict[tuple[str, str], dict]:
    return {(m["kind"], m["metadata"]["name"]): m for docs in files.values() for m in docs}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_manifests_validate_against_the_kubernetes_schemas(path):
    import kubernetes_validate

    files = render_manifests(_example(path), token="t0ken")
    for docs in files.values():
        for manifest in yaml.safe_load_all(to_yaml(docs)):  # what kubectl reads: the written YAML
            kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    kinds = sorted(kind for kind, _ in _by_kind(files))
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "Secret"] + ["Service"] * 3 + ["StatefulSet"] * 3


def test_a_colocated_run_is_refused_with_the_fix():
    path = Path(__file__).parents[2] / "examples" / sorted(COLOCATED)[0]
    with pytest.raises(ConfigError, match=r"manifests run each process in its own pod.*deployment.colocate = false"):
        render_manifests(load_config(RLConfig, ["-c", str(path), "--kubernetes.gpus", "1"]), token="t0ken")


def test_gpu_split_names_token_and_configs():
    path = next(p for p in EXAMPLES if p.parent.name == "qwen3_30b_a3b")
    objects = _by_kind(render_manifests(_example(path), token="t0ken"))
    name, host = "qwen3-30b-a3b", "{0}-{1}-0.{0}-{1}.default.svc.cluster.local"

    def container(role: str) -> dict:
        stateful_set = objects[("StatefulSet", f"{name}-{role}")]
        assert stateful_set["spec"]["serviceName"] == f"{name}-{role}"  # pod <name>-<role>-0, DNS through it
        assert objects[("Service", f"{name}-{role}")]["spec"]["clusterIP"] == "None"
        return stateful_set["spec"]["template"]["spec"]["containers"][0]

    gpus = {role: container(role).get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for role in
            ("inference", "trainer", "orchestrator")}  # fmt: skip
    assert gpus == {"inference": 2, "trainer": 6, "orchestrator": None}  # the example's split of one 8-GPU node
    assert "--nproc-per-node 6" in container("trainer")["command"][-1]
    secret = objects[("Secret", f"{name}-admin-token")]
    assert secret["stringData"] == {"token": "t0ken"}
    for role in ("inference", "orchestrator"):
        (ref,) = [e for e in container(role)["env"] if e["name"] == "SLIPSTREAM_ADMIN_TOKEN"]
        assert ref["valueFrom"]["secretKeyRef"] == {"name": f"{name}-admin-token", "key": "token"}
    data = objects[("ConfigMap", f"{name}-config")]["data"]
    inference = InferenceConfig.model_validate(tomllib.loads(data["inference.toml"]))
    orchestrator = OrchestratorConfig.model_validate(tomllib.loads(data["orchestrator.toml"]))
    trainer = TrainerConfig.model_validate(tomllib.loads(data["trainer.toml"]))
    assert (inference.host, inference.data_parallel_size, inference.enable_expert_parallel) == ("0.0.0.0", 2, True)
    assert orchestrator.inference_url == f"http://{host.format(name, 'inference')}:8000"
    assert trainer.weights.master_addr == host.format(name, "trainer") and trainer.weights.transport == "nccl"
    assert str(trainer.output_dir) == "/workspace/outputs/qwen3_30b_a3b" == str(orchestrator.output_dir)
    assert orchestrator.num_trainer_ranks == 6


def test_a_trainer_across_pods_gets_one_pod_per_node_and_a_rendezvous_at_the_first():
    """launch.trainer_nodes = 2: the trainer StatefulSet has 2 pods, each running torchrun with its ordinal as node
    rank, the rendezvous at pod 0, its own exit marker; the orchestrator writes a batch for every rank of both."""
    import kubernetes_validate

    path = next(p for p in EXAMPLES if p.parent.name == "qwen3_30b_a3b")
    files = render_manifests(_example(path, "--launch.trainer_nodes", "2"), token="t")
    objects = _by_kind(files)
    name, host = "qwen3-30b-a3b", "qwen3-30b-a3b-trainer-0.qwen3-30b-a3b-trainer.default.svc.cluster.local"
    trainer = objects[("StatefulSet", f"{name}-trainer")]
    assert (
        trainer["spec"]["replicas"] == 2 and objects[("StatefulSet", f"{name}-orchestrator")]["spec"]["replicas"] == 1
    )
    script = trainer["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert script.startswith('rank="${HOSTNAME##*-}"; ')
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0  # valid for the container's /bin/sh
    assert f'--nproc-per-node 6 --nnodes 2 --master-addr {host} --master-port 29400 --node-rank "$rank"' in script
    assert 'm=/workspace/outputs/qwen3_30b_a3b/k8s/trainer_"$rank".exit;' in script
    data = objects[("ConfigMap", f"{name}-config")]["data"]
    assert OrchestratorConfig.model_validate(tomllib.loads(data["orchestrator.toml"])).num_trainer_ranks == 12
    for manifest in yaml.safe_load_all(to_yaml(files["trainer.yaml"])):
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_a_multi_node_inference_deployment_gets_one_pod_per_node_behind_the_router_on_the_first():
    """inference.deployment with 2 nodes: 2 inference pods, each `slipstream inference` as the node of its ordinal
    (pod 0 also runs vllm-router); the deployment's nodes are the pods' DNS names, so the orchestrator's admin calls
    reach each engine on its pod and its requests the router on pod 0."""
    import kubernetes_validate

    path = next(p for p in EXAMPLES if p.name == "rl-gpu.toml")
    deployment = '{kind = "multi_node", nodes = ["a", "b"]}'
    files = render_manifests(_example(path, "--inference.deployment", deployment), token="t")
    objects = _by_kind(files)
    name = "reverse-text-gpu"
    pods = [f"{name}-inference-{k}.{name}-inference.default.svc.cluster.local" for k in (0, 1)]
    inference = objects[("StatefulSet", f"{name}-inference")]
    assert inference["spec"]["replicas"] == 2
    script = inference["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert script.endswith('--inference.deployment.node_rank "${HOSTNAME##*-}"')
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
    data = objects[("ConfigMap", f"{name}-config")]["data"]
    assert InferenceConfig.model_validate(tomllib.loads(data["inference.toml"])).deployment.nodes == pods
    orchestrator = OrchestratorConfig.model_validate(tomllib.loads(data["orchestrator.toml"]))
    assert orchestrator.inference_url == f"http://{pods[0]}:8000"
    assert orchestrator.inference_engine_urls == [f"http://{pod}:8001" for pod in pods]
    for manifest in yaml.safe_load_all(to_yaml(files["inference.yaml"])):
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_a_config_without_dtype_serves_and_trains_bfloat16_on_gpu_pods(tmp_path):
    """model.dtype left unset stays unset through the render's rebuilt configs, so GPU pods get the GPU default."""
    import tomli_w

    path = next(p for p in EXAMPLES if p.parent.name == "reverse_text" and p.name == "rl.toml")
    data = tomllib.loads(path.read_text())
    del data["model"]["dtype"]
    (tmp_path / "rl.toml").write_text(tomli_w.dumps(data))
    config = load_config(RLConfig, ["-c", str(tmp_path / "rl.toml"), "--kubernetes.gpus", "2"])
    configs = _by_kind(render_manifests(config, token="t"))[("ConfigMap", "reverse-text-config")]["data"]
    for name in ("inference.toml", "trainer.toml", "orchestrator.toml"):
        assert tomllib.loads(configs[name])["model"]["dtype"] == "bfloat16", name


def test_mooncake_master_runs_beside_the_head_inference_pod():
    path = next(p for p in EXAMPLES if p.parent.name == "qwen3_30b_a3b")
    config = _example(path, "--inference.kv_cache_offload", '{backend = "mooncake"}')
    objects = _by_kind(render_manifests(config, token="t"))
    pod = objects[("StatefulSet", "qwen3-30b-a3b-inference")]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["inference", "mooncake-master"]
    assert pod["containers"][1]["command"][0] == "mooncake_master"
    inference = tomllib.loads(objects[("ConfigMap", "qwen3-30b-a3b-config")]["data"]["inference.toml"])
    assert inference["kv_cache_offload"]["mooncake"]["master_host"].startswith("qwen3-30b-a3b-inference-0.")


def test_impossible_split_and_output_dir_outside_the_volume_are_config_errors(tmp_path, capsys):
    path = next(p for p in EXAMPLES if p.parent.name == "qwen3_30b_a3b")
    assert cli_main(["k8s", "render", "-c", str(path), "--kubernetes.gpus", "4", "--out", str(tmp_path)]) == 2
    assert "deployment.inference_gpus" in capsys.readouterr().err
    args = ["--kubernetes.gpus", "8", "--output_dir", "/elsewhere/run", "--out", str(tmp_path)]
    assert cli_main(["k8s", "render", "-c", str(path), *args]) == 2
    assert "kubernetes.mount_path" in capsys.readouterr().err


def test_cli_writes_the_manifests(tmp_path, capsys):
    path = next(p for p in EXAMPLES if p.parent.name == "reverse_text" and p.name == "rl.toml")
    out = tmp_path / "k8s"
    args = ["--kubernetes.name", "rt", "--kubernetes.namespace", "rl", "--out", str(out)]
    assert cli_main(["k8s", "render", "-c", str(path), *args]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "inference.yaml",
        "orchestrator.yaml",
        "shared.yaml",
        "trainer.yaml",
    ]
    assert (out / "shared.yaml").stat().st_mode & 0o077 == 0  # the admin token is readable by its owner only
    docs = [m for f in out.iterdir() for m in yaml.safe_load_all(f.read_text())]
    assert {m["metadata"]["namespace"] for m in docs} == {"rl"}
    assert all("nvidia.com/gpu" not in str(m) for m in docs)  # no [kubernetes] gpus: CPU pods
    assert "kubectl apply -f" in capsys.readouterr().out
    assert cli_main(["k8s", "render", "-c", str(path)]) == 2  # --out is required
    assert cli_main(["k8s", "--help"]) == 0
