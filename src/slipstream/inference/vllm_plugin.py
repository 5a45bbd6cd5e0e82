"""vLLM general plugin (entry point `vllm.general_plugins`), loaded by every vLLM process of this environment: the API
server, the engine core and each worker. It registers Slipstream's weight-transfer engine as the vLLM weight-transfer
backend `slipstream` (`--weight-transfer-config '{"backend": "slipstream"}'`)."""

from slipstream.launch.watchdog import start_from_env

ENGINE_BACKEND = "slipstream"


def register() -> None:
    """Called by vLLM's plugin loader (possibly several times in one process: registration is idempotent)."""
    start_from_env()  # vLLM loads this plugin in each of its processes: each one dies with `slipstream rl`
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            ENGINE_BACKEND, "slipstream.inference.transfer_engine", "SlipstreamWeightTransferEngine"
        )
