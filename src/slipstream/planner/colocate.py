"""`slipstream plan --colocate -c rl.toml --gpu h200 [--gpus N]`: whether the run's model fits colocated (vLLM and the
trainer sharing each GPU, deployment.colocate) at each sleep level, and vLLM's share of memory where it does; where
it does not, the knob to turn. The same plan `slipstream rl` applies at launch (launch/colocate_memory.py)."""

import argparse
import sys
from pathlib import Path

from slipstream.config.base import ConfigError
from slipstream.planner.hardware import GPUS

GIB = 2**30


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="slipstream plan --colocate",
        description="Whether the model of an RL config fits on GPUs shared by vLLM and the trainer (colocated).",
    )
    p.add_argument("--colocate", action="store_true", required=True)
    p.add_argument("-c", "--config", action="append", required=True, type=Path, help="rl.toml (repeatable)")
    p.add_argument("--gpu", choices=sorted(GPUS), required=True)
    p.add_argument("--gpus", type=int, default=1, help="GPUs shared (default: %(default)s)")
    return p.parse_known_args(argv)


def main(argv: list[str]) -> int:
    from slipstream.config.loader import load_config
    from slipstream.config.rl import RLConfig
    from slipstream.launch.colocate_memory import ModelShape, model_parameters, plan_colocated
    from slipstream.launch.placement import PlacementError
    from slipstream.launch.plan import _local_config_json

    args, overrides = parse_args(argv)
    try:
        if args.gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {args.gpus}")
        config = load_config(RLConfig, [x for path in args.config for x in ("-c", str(path))] + overrides)
        found = _local_config_json(str(config.model.path or config.model.name))
        if found is None:
            raise ConfigError(
                f"model {config.model.name!r} is not on this machine; import or download it first (slipstream model "
                "import ...) so its size can be read"
            )
        folder = found.parent
        num_params, shape = model_parameters(folder), ModelShape.read(folder)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    gpu = GPUS[args.gpu]
    gpu_bytes = int(gpu.memory_gib * GIB)
    asked = config.deployment.sleep_level
    print(
        f"colocated on {args.gpus} x {gpu.name.upper()} ({gpu.memory_gib:g} GiB): {config.model.name} "
        f"({num_params / 1e9:.2f}B parameters), micro_batch_tokens {config.orchestrator.micro_batch_tokens}"
    )
    fits = {}
    for level in (1, 2, 0):
        leveled = config.rebuilt({"deployment": {"sleep_level": level}})
        try:
            plan = plan_colocated(leveled, num_params, shape, gpu_bytes, args.gpus)
            fits[level] = True
            print(f"  sleep_level {level}{' (configured)' if level == asked else ''}: fits; {plan.summary()}")
        except PlacementError as e:
            fits[level] = False
            print(f"  sleep_level {level}{' (configured)' if level == asked else ''}: does not fit: {e}")
    return 0 if fits[asked] else 1
