"""Kubernetes manifests of a `slipstream rl` run (plain YAML, no Helm): one StatefulSet per process (inference,
trainer, orchestrator) with a headless Service, so pod names and DNS names are predictable
(`<name>-<role>-0.<name>-<role>.<namespace>.svc.cluster.local`); a shared ReadWriteMany volume for the run directory
and the model cache; the per-process configs in a ConfigMap; the admin token in a Secret read through env.

GPUs follow the split `slipstream rl` computes on one node ([deployment] placed on `kubernetes.gpus` GPUs): each pod
requests its share as `nvidia.com/gpu` and sees only those, so no CUDA_VISIBLE_DEVICES is set. A StatefulSet always
restarts a pod whose container exits, so the trainer and orchestrator record their exit code on the shared volume: after
a clean finish their container idles (the run is not started again); after a failure it keeps failing with that code
(CrashLoopBackOff, the first run's logs in `kubectl logs --previous`) instead of starting the run over.
"""

import secrets
import shlex
from pathlib import PurePosixPath
from typing import Any

import tomli_w

from slipstream.config.base import ConfigError
from slipstream.config.rl import RLConfig
from slipstream.inference.admin_token import TOKEN_ENV
from slipstream.inference.options import mooncake_master_argv
from slipstream.launch.placement import Placement
from slipstream.launch.plan import place_config, placement_changes

ROLES = ("inference", "trainer", "orchestrator")
CONFIG_DIR = "/etc/slipstream"
GPU_RESOURCE = "nvidia.com/gpu"

Manifest = dict[str, Any]


def run_name(config: RLConfig) -> str:
    """kubernetes.name, or the run directory's name as a DNS label."""
    if config.kubernetes.name is not None:
        return config.kubernetes.name
    raw = "".join(c if c.isalnum() else "-" for c in PurePosixPath(config.output_dir).name.lower()).strip("-")
    return (raw or "slipstream")[:40].strip("-")


def pod_host(config: RLConfig, role: str, ordinal: int = 0) -> str:
    """DNS name of the role's pod `ordinal` (the first: the only one, or the head), through its headless Service."""
    name = run_name(config)
    return f"{name}-{role}-{ordinal}.{name}-{role}.{config.kubernetes.namespace}.svc.cluster.local"


def num_inference_pods(config: RLConfig) -> int:
    """One inference pod per node of the inference deployment (inference.deployment.nodes: their addresses become
    the pods' DNS names)."""
    return len(config.inference.deployment.nodes)


def cluster_config(config: RLConfig) -> tuple[RLConfig, Placement]:
    """The run as the pods see it: output_dir on the shared volume, inference listening on its pod address and
    reached by DNS, the weight rendezvous at the trainer pod, and the deployment placed on one node's GPUs (raises
    ConfigError naming the fields when the split is impossible)."""
    k8s = config.kubernetes
    output_dir = PurePosixPath(config.output_dir)
    if not output_dir.is_absolute():
        output_dir = PurePosixPath(k8s.mount_path) / output_dir
    elif not output_dir.is_relative_to(k8s.mount_path):
        raise ConfigError(
            f"output_dir = {str(output_dir)!r} is outside the shared volume (kubernetes.mount_path = "
            f"{k8s.mount_path!r}); use a relative output_dir, or one below kubernetes.mount_path"
        )
    inference: dict[str, Any] = {"host": "0.0.0.0"}
    if num_inference_pods(config) > 1:  # the deployment's nodes are the inference pods, the head (router) first
        nodes = [pod_host(config, "inference", k) for k in range(num_inference_pods(config))]
        inference["deployment"] = {"nodes": nodes}
    offload = config.inference.kv_cache_offload
    if offload is not None and offload.backend == "mooncake":
        inference["kv_cache_offload"] = {"mooncake": {"master_host": pod_host(config, "inference")}}
    changes = {
        "output_dir": str(output_dir),
        "inference": inference,
        "orchestrator": {"inference_url": f"http://{pod_host(config, 'inference')}:{config.inference.port}"},
        # Pods have their own network namespace: a fixed port (weights.master_port 0 = auto is a launcher choice).
        "weights": {"master_addr": pod_host(config, "trainer"), "master_port": config.weights.master_port or 29611},
        "launch": {"trainer_master_addr": pod_host(config, "trainer")},  # torchrun's rendezvous across trainer pods
    }
    config = config.rebuilt(changes)
    placement = place_config(config, list(range(k8s.gpus)))
    if placement.colocated:
        raise ConfigError(
            "deployment.colocate: vLLM and the trainer share GPUs inside one process tree, but the manifests run each "
            "process in its own pod (with its own GPUs); set deployment.colocate = false and kubernetes.gpus to at "
            "least 2, or run colocated with `slipstream rl` on the machine itself"
        )
    return config.rebuilt(placement_changes(config, placement)), placement


def to_yaml(docs: list[Manifest]) -> str:
    """YAML documents, multi-line strings (the TOML configs, shell scripts) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False)


def render_manifests(config: RLConfig, token: str | None = None) -> dict[str, list[Manifest]]:
    """File name -> the manifests it holds. `token`: the admin token (None: a fresh random one)."""
    config, placement = cluster_config(config)
    name = run_name(config)
    gpus = {"inference": len(placement.inference_gpus), "trainer": len(placement.trainer_gpus), "orchestrator": 0}
    files = {
        "shared.yaml": [_secret(config, token or secrets.token_urlsafe(32)), _config_map(config), _volume(config)],
    }
    for role in ROLES:
        container = _container(config, role, _command(config, role, placement), gpus[role])
        containers = [container] + (_mooncake_sidecar(config) if role == "inference" else [])
        ports = [p for c in containers for p in c.get("ports", [])]
        files[f"{role}.yaml"] = [_service(config, role, ports), _stateful_set(config, role, containers)]
    assert all(m["metadata"]["name"].startswith(name) for docs in files.values() for m in docs)
    return files


def _command(config: RLConfig, role: str, placement: Placement) -> list[str]:
    config_file = f"{CONFIG_DIR}/{role}.toml"
    markers = shlex.quote(f"{config.output_dir}/k8s")
    if role == "inference":
        argv = ["python", "-m", "slipstream", "inference", "-c", config_file]
        if num_inference_pods(config) == 1:
            return argv
        # one pod per node of the deployment: its rank is the StatefulSet ordinal (the head, 0, runs the router)
        rank = '"${HOSTNAME##*-}"'
        return ["/bin/sh", "-c", f"exec {shlex.join(argv)} --inference.deployment.node_rank {rank}"]
    if role == "trainer":
        launch = config.launch
        torchrun = ["python", "-m", "torch.distributed.run", "--nproc-per-node", str(placement.num_trainer_procs)]
        run = shlex.join(["-m", "slipstream", "trainer", "-c", config_file])
        if launch.trainer_nodes == 1:
            return [
                "/bin/sh",
                "-c",
                _run_once(f"{shlex.join([*torchrun, '--standalone'])} {run}", f"{markers}/trainer.exit"),
            ]
        # one pod per trainer node: its rank is the StatefulSet ordinal (pod <name>-trainer-<rank>)
        nodes = ["--nnodes", str(launch.trainer_nodes), "--master-addr", launch.trainer_master_addr]
        nodes += ["--master-port", str(launch.trainer_master_port)]
        command = f'{shlex.join([*torchrun, *nodes])} --node-rank "$rank" {run}'
        return ["/bin/sh", "-c", 'rank="${HOSTNAME##*-}"; ' + _run_once(command, f'{markers}/trainer_"$rank".exit')]
    command = shlex.join(["python", "-m", "slipstream", "orchestrator", "-c", config_file])
    return ["/bin/sh", "-c", _run_once(command, f"{markers}/orchestrator.exit")]


def _run_once(command: str, marker: str) -> str:
    """Shell that runs `command` once per run: its exit code is kept in the file `marker` (a shell word); a
    restarted container idles after a success and fails again with the recorded code after a failure (delete the
    marker to run it again)."""
    return (
        f"m={marker}; "
        'if [ -f "$m" ]; then rc=$(cat "$m"); echo "already ran (exit $rc, recorded in $m)"; '
        '[ "$rc" = 0 ] && exec sleep infinity; exit "$rc"; fi; '
        f'mkdir -p "$(dirname "$m")"; {command}; rc=$?; echo "$rc" > "$m"; '
        '[ "$rc" = 0 ] && exec sleep infinity; exit "$rc"'
    )


def _labels(config: RLConfig, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "slipstream", "app.kubernetes.io/instance": run_name(config)}
    return labels | ({"app.kubernetes.io/component": role} if role else {})


def _meta(config: RLConfig, name: str, role: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": config.kubernetes.namespace, "labels": _labels(config, role)}


def _container(config: RLConfig, role: str, command: list[str], gpus: int) -> Manifest:
    k8s, mount = config.kubernetes, config.kubernetes.mount_path
    env = {"PYTHONUNBUFFERED": "1", "HF_HOME": f"{mount}/hf", "SLIPSTREAM_CACHE_DIR": f"{mount}/slipstream-cache"}
    env_list: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in (env | k8s.env).items()]
    if role in ("inference", "orchestrator"):
        secret = {"secretKeyRef": {"name": f"{run_name(config)}-admin-token", "key": "token"}}
        env_list.append({"name": TOKEN_ENV, "valueFrom": secret})
    container: Manifest = {
        "name": role,
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": command,
        "env": env_list,
        "volumeMounts": [
            {"name": "shared", "mountPath": mount},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if gpus:
        container["resources"] = {"requests": {GPU_RESOURCE: gpus}, "limits": {GPU_RESOURCE: gpus}}
    port = {"inference": config.inference.port, "trainer": config.weights.master_port}.get(role)
    if port is not None:
        container["ports"] = [{"name": "http" if role == "inference" else "rendezvous", "containerPort": port}]
    if role == "inference":
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 10}
    return container


def _mooncake_sidecar(config: RLConfig) -> list[Manifest]:
    """The Mooncake master with its HTTP metadata server, beside vLLM on the head inference pod."""
    offload = config.inference.kv_cache_offload
    if offload is None or offload.backend != "mooncake":
        return []
    mooncake = offload.mooncake
    return [
        {
            "name": "mooncake-master",
            "image": config.kubernetes.image,
            "imagePullPolicy": config.kubernetes.image_pull_policy,
            "command": mooncake_master_argv(mooncake),
            "ports": [
                {"name": "mooncake-rpc", "containerPort": mooncake.master_port},
                {"name": "mooncake-meta", "containerPort": mooncake.metadata_port},
            ],
        }
    ]


def _stateful_set(config: RLConfig, role: str, containers: list[Manifest]) -> Manifest:
    k8s, name = config.kubernetes, f"{run_name(config)}-{role}"
    pod: Manifest = {
        "containers": containers,
        "volumes": [
            {"name": "shared", "persistentVolumeClaim": {"claimName": f"{run_name(config)}-shared"}},
            {"name": "config", "configMap": {"name": f"{run_name(config)}-config"}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}},
        ],
    }
    if k8s.node_selector:
        pod["nodeSelector"] = dict(k8s.node_selector)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(config, name, role),
        "spec": {
            "serviceName": name,
            "replicas": {"trainer": config.launch.trainer_nodes, "inference": num_inference_pods(config)}.get(role, 1),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(config, role)},
            "template": {"metadata": {"labels": _labels(config, role)}, "spec": pod},
        },
    }


def _service(config: RLConfig, role: str, ports: list[Manifest]) -> Manifest:
    spec: Manifest = {"clusterIP": "None", "selector": _labels(config, role), "publishNotReadyAddresses": True}
    if ports:
        spec["ports"] = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(config, f"{run_name(config)}-{role}"),
        "spec": spec,
    }


def _secret(config: RLConfig, token: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(config, f"{run_name(config)}-admin-token"),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def _config_map(config: RLConfig) -> Manifest:
    data = {f"{role}.toml": tomli_w.dumps(getattr(config, role).to_toml_dict()) for role in ROLES}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(config, f"{run_name(config)}-config"),
        "data": data,
    }


def _volume(config: RLConfig) -> Manifest:
    k8s = config.kubernetes
    spec: Manifest = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": k8s.storage_size}}}
    if k8s.storage_class is not None:
        spec["storageClassName"] = k8s.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(config, f"{run_name(config)}-shared"),
        "spec": spec,
    }
