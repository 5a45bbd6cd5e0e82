"""Config of `[kubernetes]`: what `slipstream k8s render` needs beyond the run itself (image, namespace, storage,
the GPUs of one node). `slipstream rl` ignores it."""

import re
from pathlib import PurePosixPath
from typing import Literal

from pydantic import Field, field_validator

from slipstream.config.base import BaseConfig

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class KubernetesConfig(BaseConfig):
    """Kubernetes manifests for the run (`slipstream k8s render -c rl.toml --out DIR`; see docs/kubernetes.md): one
    StatefulSet per process with a headless Service, a shared ReadWriteMany volume for the run directory and model
    cache, and the admin token as a Secret. GPUs are split by [deployment] as `slipstream rl` splits a node showing
    `gpus` GPUs; each pod requests its share (`nvidia.com/gpu`)."""

    name: str | None = Field(None, max_length=40)
    """Prefix of every object's name (pods are `<name>-inference-0`, `<name>-trainer-0`, `<name>-orchestrator-0`), a
    DNS label; None: the run directory's name, lower-cased, other characters turned into `-`."""

    namespace: str = "default"
    """Namespace of every object."""

    image: str = "slipstream:0.1.0"
    """Container image with Slipstream and vLLM's GPU build installed; the same image runs every process. The
    default is the tag the repository's Dockerfile is built with (`docker build -t slipstream:0.1.0 .`); push the
    image to a registry the cluster pulls from and name it here (`REGISTRY/slipstream:0.1.0`)."""

    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When the kubelet pulls the image."""

    gpus: int = Field(0, ge=0)
    """GPUs of one node: [deployment] splits them between inference and trainer (e.g. 8 with the defaults: 4 and 4),
    and each of those pods requests its share. 0: everything on CPU (no GPU requests)."""

    storage_size: str = "200Gi"
    """Size of the shared volume (PersistentVolumeClaim) holding the run directory and the model cache."""

    storage_class: str | None = None
    """StorageClass of the shared volume; it must offer ReadWriteMany (NFS, CephFS, Lustre, a cloud filestore).
    None: the cluster's default class."""

    mount_path: str = "/workspace"
    """Where the shared volume is mounted in every pod; output_dir (if relative) and the model cache live below it."""

    shm_size: str = "16Gi"
    """Size of each pod's /dev/shm (vLLM and torchrun exchange tensors through it)."""

    node_selector: dict[str, str] = {}
    """Node labels every pod must match, e.g. `{"nvidia.com/gpu.product" = "NVIDIA-H100-80GB-HBM3"}`."""

    env: dict[str, str] = {}
    """Environment variables of every container (e.g. `HF_TOKEN` is better given as a Secret; `NCCL_SOCKET_IFNAME`)."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        if value is not None and not DNS_LABEL.match(value):
            raise ValueError(
                f"kubernetes.name = {value!r} must be a DNS label: lower-case letters, digits and '-', starting and "
                "ending with a letter or digit"
            )
        return value

    @field_validator("namespace")
    @classmethod
    def _check_namespace(cls, value: str) -> str:
        if not DNS_LABEL.match(value) or len(value) > 63:
            raise ValueError(f"kubernetes.namespace = {value!r} must be a DNS label (lower-case, digits, '-')")
        return value

    @field_validator("mount_path")
    @classmethod
    def _check_mount(cls, value: str) -> str:
        if not PurePosixPath(value).is_absolute():
            raise ValueError(f"kubernetes.mount_path = {value!r} must be an absolute path, e.g. /workspace")
        return value
