"""vLLM general plugin (entry point `vllm.general_plugins`), loaded by every vLLM process of this environment: the API
server, the engine core and each worker. It registers Slipstream's weight-transfer engine as the vLLM weight-transfer
backend `slipstream` (`--weight-transfer-config '{"backend": "slipstream"}'`), and sends the `slipstream` loggers'
INFO lines to the process's output next to vLLM's own (vLLM configures its `vllm` logger only), so the server log says
how each weight version was received and loaded."""

import logging
import sys

from slipstream.launch.watchdog import start_from_env

ENGINE_BACKEND = "slipstream"


def register() -> None:
    """Called by vLLM's plugin loader (possibly several times in one process: registration is idempotent)."""
    start_from_env()  # vLLM loads this plugin in each of its processes: each one dies with `slipstream rl`
    _log_like_vllm()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            ENGINE_BACKEND, "slipstream.weights.receive.engine", "SlipstreamWeightTransferEngine"
        )


def _log_like_vllm() -> None:
    """The `slipstream` loggers' records to stdout as the other processes' lines (monitor/logs.py: level from
    SLIPSTREAM_LOG_LEVEL, INFO by default), once per process, where the root logger has no handler (vLLM configures
    its `vllm` logger only), without touching the root logger."""
    from slipstream.monitor.logs import build_formatter, resolve_level

    log = logging.getLogger("slipstream")
    if log.handlers or logging.getLogger().handlers:
        return  # done already, or the process routes records itself (a test, a process that set up logging)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(build_formatter("vllm"))
    log.addHandler(handler)
    log.setLevel(resolve_level())
    log.propagate = False
