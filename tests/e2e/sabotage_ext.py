"""A deliberately broken weight load for tests: vLLM imports this module into each worker (`--worker-extension-cls`),
and importing it makes Slipstream's weight-transfer engine report success while loading nothing (the "frozen policy"
failure users hit when a weight sync silently fails)."""

from slipstream.inference.transfer_engine import SlipstreamWeightTransferEngine


def _receive_nothing(self, update_info) -> None:
    return None


SlipstreamWeightTransferEngine.receive_weights = _receive_nothing


class FrozenWeightLoader:
    """The worker extension named on the command line: it adds nothing; importing this module is the sabotage."""
