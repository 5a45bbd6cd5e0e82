"""Deliberately broken weight loads for tests: vLLM imports this module into each worker (`--worker-extension-cls`),
and importing it breaks Slipstream's weight-transfer engine the way the sabotage mode says, while it still reports
success:
- `frozen` (default): nothing is loaded (the "frozen policy" users hit when a weight sync silently fails);
- `skip_layer`: every version's tensors of layer 1 are dropped before the model's loader (what a lost bucket holding
  that layer leaves, whatever the transport's bucket sizes), so the layer keeps the weights vLLM started with (the
  engine's own accounting catches it: weights/receive/receiver.check_loaded);
- `swap_layers`: layers 0 and 1 receive each other's weights;
- `slow`: nothing is broken, every version is received `SLIPSTREAM_SABOTAGE_SLOW_S` seconds (default 3) late: a
  transfer stays in flight long enough for a test to kill vLLM in its middle;
- `none`: nothing is broken.
The mode is `SLIPSTREAM_SABOTAGE`, fixed for the server's life, or, where `SLIPSTREAM_SABOTAGE_FILE` names a file, that
file's text read at each version (one server for several runs, each with its own sabotage). The model's initial
weights loaded back on a server that served another run (update_info `model`) are never sabotaged.
"""

import os
import re
import time
from pathlib import Path

from slipstream.weights.receive.engine import SlipstreamWeightTransferEngine

MODES = ("frozen", "skip_layer", "swap_layers", "slow", "none")
SKIPPED = re.compile(r"\.layers\.1\.")
_load = SlipstreamWeightTransferEngine._load
_load_wire = SlipstreamWeightTransferEngine._load_wire
_receive = SlipstreamWeightTransferEngine.receive_weights


def current_mode() -> str:
    path = os.environ.get("SLIPSTREAM_SABOTAGE_FILE")
    mode = Path(path).read_text().strip() if path else os.environ.get("SLIPSTREAM_SABOTAGE", "frozen")
    if mode not in MODES:
        raise ValueError(f"sabotage mode {mode!r}: use one of {', '.join(MODES)}")
    return mode


def _swap(name: str) -> str:
    return re.sub(r"\.layers\.([01])\.", lambda m: f".layers.{1 - int(m.group(1))}.", name)


def _receive_sabotaged(self, update_info) -> None:
    self.sabotage = "none" if update_info.model is not None else current_mode()
    if self.sabotage == "frozen":
        return
    if self.sabotage == "slow":
        time.sleep(float(os.environ.get("SLIPSTREAM_SABOTAGE_SLOW_S", "3")))
    _receive(self, update_info)


def _load_sabotaged(self, pairs) -> None:
    mode = getattr(self, "sabotage", "none")
    if mode == "skip_layer":
        pairs = [(name, tensor) for name, tensor in pairs if not SKIPPED.search(name)]
    elif mode == "swap_layers":
        pairs = [(_swap(name), tensor) for name, tensor in pairs]
    if pairs:
        _load(self, pairs)


def _load_wire_sabotaged(self, bucket, wire) -> bool:
    if getattr(self, "sabotage", "none") in ("skip_layer", "swap_layers"):
        return False  # every bucket through _load
    return _load_wire(self, bucket, wire)


current_mode()  # a mode that does not exist fails vLLM's start
SlipstreamWeightTransferEngine.receive_weights = _receive_sabotaged
SlipstreamWeightTransferEngine._load = _load_sabotaged
SlipstreamWeightTransferEngine._load_wire = _load_wire_sabotaged


class FrozenWeightLoader:
    """The worker extension named on the command line: it adds nothing; importing this module is the sabotage."""
