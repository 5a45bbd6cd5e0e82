"""Deliberately broken weight loads for tests: vLLM imports this module into each worker (`--worker-extension-cls`),
and importing it breaks Slipstream's weight-transfer engine the way `SLIPSTREAM_SABOTAGE` says, while it still reports
success:
- `frozen` (default): nothing is loaded (the "frozen policy" users hit when a weight sync silently fails);
- `skip_layer`: every version's tensors of layer 1 are dropped before the model's loader (what a lost bucket holding
  that layer leaves, whatever the transport's bucket sizes), so the layer keeps the weights vLLM started with (the
  engine's own accounting catches it: transport/weight_receiver.check_loaded);
- `swap_layers`: layers 0 and 1 receive each other's weights;
- `slow`: nothing is broken, every version is received `SLIPSTREAM_SABOTAGE_SLOW_S` seconds (default 3) late: a
  transfer stays in flight long enough for a test to kill vLLM in its middle.
"""

import os
import re
import time

from slipstream.inference.transfer_engine import SlipstreamWeightTransferEngine

MODE = os.environ.get("SLIPSTREAM_SABOTAGE", "frozen")
SKIPPED = re.compile(r"\.layers\.1\.")
_load = SlipstreamWeightTransferEngine._load
_receive = SlipstreamWeightTransferEngine.receive_weights


def _receive_nothing(self, update_info) -> None:
    return None


def _load_skipping(self, pairs) -> None:
    kept = [(name, tensor) for name, tensor in pairs if not SKIPPED.search(name)]
    if kept:
        _load(self, kept)


def _receive_late(self, update_info) -> None:
    time.sleep(float(os.environ.get("SLIPSTREAM_SABOTAGE_SLOW_S", "3")))
    _receive(self, update_info)


def _swap(name: str) -> str:
    return re.sub(r"\.layers\.([01])\.", lambda m: f".layers.{1 - int(m.group(1))}.", name)


def _load_swapped(self, pairs) -> None:
    _load(self, [(_swap(name), tensor) for name, tensor in pairs])


if MODE == "frozen":
    SlipstreamWeightTransferEngine.receive_weights = _receive_nothing
elif MODE == "skip_layer":
    SlipstreamWeightTransferEngine._load = _load_skipping
    SlipstreamWeightTransferEngine._load_wire = lambda self, bucket, wire: False  # every bucket through _load
elif MODE == "swap_layers":
    SlipstreamWeightTransferEngine._load = _load_swapped
    SlipstreamWeightTransferEngine._load_wire = lambda self, bucket, wire: False
elif MODE == "slow":
    SlipstreamWeightTransferEngine.receive_weights = _receive_late
else:
    raise ValueError(f"SLIPSTREAM_SABOTAGE={MODE!r}: use frozen, skip_layer, swap_layers or slow")


class FrozenWeightLoader:
    """The worker extension named on the command line: it adds nothing; importing this module is the sabotage."""
