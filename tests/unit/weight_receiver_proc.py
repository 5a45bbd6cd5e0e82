"""A receiving worker for tests, in its own process: joins the trainer's group of a session and receives one version
by broadcast with transport.weight_receiver (the code of Slipstream's vLLM engine), then saves what it got.
`--die-after K` exits abruptly after K buckets, like an inference server killed mid-transfer.

python -m tests.unit.weight_receiver_proc RUN_DIR STEP SESSION WORLD_SIZE PORT OUT [--die-after K]
"""

import argparse
import os
from pathlib import Path

import torch

from slipstream.transport.collective import GroupInit
from slipstream.transport.weight_offers import read_manifest
from slipstream.transport.weight_receiver import WeightReceiver


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("run_dir", "step", "session", "world_size", "port", "out"):
        parser.add_argument(name)
    parser.add_argument("--die-after", type=int, default=-1)
    args = parser.parse_args()
    receiver = WeightReceiver(torch.device("cpu"))
    receiver.join(GroupInit("gloo", "127.0.0.1", int(args.port), args.session, int(args.world_size), timeout_s=60))
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
