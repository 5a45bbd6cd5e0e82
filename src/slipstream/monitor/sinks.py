"""A process's monitoring sinks from its `monitor` config: the Prometheus endpoint (trainer on
`monitor.prometheus_port`, orchestrator on the next port) and, for the trainer, the Weights & Biases run."""

import logging
from typing import Any

log = logging.getLogger(__name__)

PROMETHEUS_PORT_OFFSET = {"trainer": 0, "orchestrator": 1}
"""Each process's port relative to monitor.prometheus_port."""


class Monitors:
    def __init__(self, config: Any, process: str) -> None:
        """`config`: the process's config (its `monitor`, `output_dir` and the rest, logged as the wandb run config)."""
        monitor = config.monitor
        self.prometheus = None
        self.wandb = None
        if monitor.prometheus_port is not None:
            from slipstream.monitor.prometheus import PrometheusExporter

            port = monitor.prometheus_port + PROMETHEUS_PORT_OFFSET[process]
            self.prometheus = PrometheusExporter(monitor.prometheus_host, port, process)
            log.info(f"Prometheus metrics on http://{monitor.prometheus_host}:{port}/metrics")
        if monitor.wandb is not None and process == "trainer":  # the trainer's records hold both processes' metrics
            from slipstream.monitor.wandb_run import WandbRun

            self.wandb = WandbRun(monitor.wandb, config.output_dir, config.model_dump(mode="json"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.prometheus is not None:
            self.prometheus.update(step, metrics)
        if self.wandb is not None:
            self.wandb.log(step, metrics)

    def close(self) -> None:
        if self.prometheus is not None:
            self.prometheus.close()
        if self.wandb is not None:
            self.wandb.finish()
