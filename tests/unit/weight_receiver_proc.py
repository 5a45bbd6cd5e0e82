"""A receiving worker for tests, in its own process: joins the trainer's group of a session and receives one version
by broadcast with weights.receive.receiver (the code of Slipstream's vLLM engine), then saves what it got.
`--die-after K` exits abruptly after K buckets, like an inference server killed mid-transfer.

python -m tests.unit.weight_receiver_proc RUN_DIR STEP SESSION WORLD_SIZE PORT OUT [--die-after K] [--rank-offset N]
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.config.weights import WeightsConfig
from slipstream.weights.receive.receiver import WeightReceiver
from slipstream.weights.wire.collective import GroupInit
from slipstream.weights.wire.offers import read_manifest

REPO_ROOT = Path(__file__).resolve().parents[2]


def start_receiver(
    run_dir: Path, step: int, session: str, world_size: int, port: int, out: Path, die_after: int = -1, senders: int = 1
) -> subprocess.Popen:
    """This module as a process: a receiver of `step` in `session` (group of `world_size`, after `senders` trainer
    ranks) saving what it got to `out`."""
    argv = [sys.executable, "-m", "tests.unit.weight_receiver_proc", str(run_dir), str(step), session, str(world_size)]
    argv += [str(port), str(out), "--die-after", str(die_after), "--rank-offset", str(senders)]
    return subprocess.Popen(argv, cwd=REPO_ROOT)


def gloo_trainer_config(model_dir: Path, output_dir: Path, port: int, max_steps: int, **weights) -> TrainerConfig:
    """A CPU trainer of `max_steps` publishing by gloo broadcast in 1 MB buckets (several buckets for a tiny model)."""
    w = WeightsConfig(transport="gloo", master_port=port, bucket_mb=1, accept_timeout_s=120, **weights)
    return TrainerConfig(
        model=ModelConfig(name=str(model_dir)), output_dir=output_dir, max_steps=max_steps, device="cpu", weights=w
    )


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("run_dir", "step", "session", "world_size", "port", "out"):
        parser.add_argument(name)
    parser.add_argument("--die-after", type=int, default=-1)
    parser.add_argument("--rank-offset", type=int, default=1, help="trainer ranks that send (the group's first ranks)")
    args = parser.parse_args()
    receiver = WeightReceiver(torch.device("cpu"))
    senders = args.rank_offset  # the trainer ranks that send come first
    init = GroupInit("gloo", "127.0.0.1", int(args.port), args.session, int(args.world_size), senders, 60, senders)
    receiver.join(init)
    got: dict[str, torch.Tensor] = {}

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        got.update({name: tensor.clone() for name, tensor in pairs})
        if args.die_after >= 0 and len(got) and load.num_buckets + 1 >= args.die_after:
            os._exit(3)  # noqa: SLF001 - an abrupt death, no cleanup: what a killed server looks like to the sender
        load.num_buckets += 1

    load.num_buckets = 0
    step = int(args.step)
    stats = receiver.receive({"step": step, "manifest": read_manifest(Path(args.run_dir), step)}, load)
    torch.save({"tensors": got, "stats": stats.to_dict()}, args.out)
    receiver.shutdown()


if __name__ == "__main__":
    main()
