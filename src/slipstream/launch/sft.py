"""`slipstream sft` on this machine: the device and dtype the hardware suggests (CUDA and bfloat16 where GPUs show,
the CPU and float32 elsewhere), and with several ranks the same command started again under torchrun, one rank per
GPU, as `slipstream rl` starts its trainer (launch/plan.py). Under torchrun already, each rank just trains."""

import os
import sys
from collections.abc import Sequence

from slipstream.config.base import ConfigError
from slipstream.config.sft import SFTConfig
from slipstream.launch.placement import detect_visible_gpus
from slipstream.launch.plan import torchrun_argv
from slipstream.rundir import RunDir

TORCHRUN_MARKER = "LOCAL_RANK"
"""Set by torchrun in every rank's environment (and read by parallel/dist.py): this process is a rank already."""


def run_sft_command(config: SFTConfig) -> int:
    """Train here (one rank, or a rank of a torchrun job), or replace this process with torchrun starting
    `sft_procs` ranks; the exit code."""
    try:
        gpus = [] if config.device == "cpu" else detect_visible_gpus()
        config = resolve_sft_config(config, gpus)
        procs = 1 if TORCHRUN_MARKER in os.environ else sft_procs(config, gpus)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if procs == 1:
        from slipstream.trainer.sft import run_sft

        run_sft(config)
        return 0
    argv, env = build_sft_torchrun(config, procs, gpus)
    where = f"GPUs {env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else "the CPU"
    _say(f"starting {procs} ranks on {where} under torchrun: {' '.join(argv)}")
    _exec(argv, {**os.environ, **env})
    return 0  # not reached: _exec replaces this process


def resolve_sft_config(config: SFTConfig, gpus: Sequence[int]) -> SFTConfig:
    """`device` "auto" made concrete (CUDA when `gpus`, the GPUs this machine shows, is not empty), and model.dtype,
    when unset, bfloat16 on CUDA (float32, the default, stays on the CPU)."""
    device = "cuda" if config.device == "cuda" or (config.device == "auto" and gpus) else "cpu"
    update: dict = {"device": device}
    if "dtype" not in config.model.model_fields_set and device == "cuda":
        update["model"] = config.model.model_copy(update={"dtype": "bfloat16"})
    return config.model_copy(update=update)


def sft_procs(config: SFTConfig, gpus: Sequence[int]) -> int:
    """Ranks to start on this machine: num_procs, else one per visible GPU (1 on the CPU)."""
    if config.device != "cuda" or not gpus:
        return config.num_procs or 1
    if config.num_procs is not None and config.num_procs > len(gpus):
        raise ConfigError(
            f"num_procs = {config.num_procs}, but this machine shows {len(gpus)} GPU(s) ({list(gpus)}), one per rank; "
            "lower num_procs, or leave it unset for one rank per visible GPU"
        )
    return config.num_procs or len(gpus)


def build_sft_torchrun(config: SFTConfig, procs: int, gpus: Sequence[int]) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line that runs `slipstream sft` as `procs` ranks of this machine on the resolved config,
    written to `output_dir/config/sft.toml`, and the variables added to its environment (the ranks' GPUs)."""
    path = RunDir(config.output_dir).config_path("sft")
    path.parent.mkdir(parents=True, exist_ok=True)
    config.model_copy(update={"num_procs": None}).write_toml(path)
    argv = [*torchrun_argv(sys.executable, ["--standalone"], procs), "sft", "-c", str(path)]
    env = {"PYTHONUNBUFFERED": "1"}
    if config.device == "cuda" and gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in list(gpus)[:procs])
    return argv, env


def _exec(argv: list[str], env: dict[str, str]) -> None:
    """Replace this process with `argv`: torchrun gets this terminal's signals and its exit code is the command's."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)


def _say(message: str) -> None:
    print(f"[slipstream] {message}", flush=True)
