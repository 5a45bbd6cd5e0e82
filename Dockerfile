# The GPU image of Slipstream: every pod `slipstream k8s render` writes runs it (docs/kubernetes.md), and it runs
# `slipstream rl` on one GPU node too. Slipstream with vLLM's GPU build, on PyTorch's official CUDA image whose torch is
# the one that vLLM wheel pins (vLLM 0.26.0: torch 2.11.0, built for CUDA 13.0), so pip keeps the image's torch.
#
#   docker build -t slipstream:0.1.0 .
#   docker run --rm --gpus all slipstream:0.1.0 doctor
#   slipstream k8s render -c rl.toml --kubernetes.image REGISTRY/slipstream:0.1.0 --out k8s/
#
# Another vLLM release of the supported range (the `gpu` extra): --build-arg VLLM_VERSION=0.33.0 with the PyTorch image
# of the torch that release pins (--build-arg BASE_IMAGE=...).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG VLLM_VERSION=0.26.0

# Triton (vLLM's and torch.compile's kernels) compiles a small C launcher when it first runs: it needs a C compiler.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/slipstream
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
# The project itself, from this folder: its dependencies are bounded in pyproject.toml, vLLM pinned here
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gpu]" "vllm==${VLLM_VERSION}" \
    && python -c "import torch, vllm, slipstream; print('torch', torch.__version__, 'vllm', vllm.__version__)"

# Not root: the pods write only to the shared volume (kubernetes.mount_path) and /dev/shm; caches (Triton, vLLM,
# torch.compile) go to this user's home
RUN useradd --create-home --uid 1000 --shell /bin/bash slipstream
USER 1000
WORKDIR /home/slipstream
ENV PYTHONUNBUFFERED=1

ENTRYPOINT ["slipstream"]
CMD ["--help"]
