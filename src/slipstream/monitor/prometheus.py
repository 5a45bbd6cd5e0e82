"""A Prometheus `/metrics` endpoint for one process (prometheus_client's own server and registry): each step's
numeric metrics as gauges `slipstream_<name>`, and `slipstream_step`."""

import math
import re
from typing import Any

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def gauge_name(metric: str) -> str:
    """`reward/mean` -> `slipstream_reward_mean` (Prometheus names allow [a-zA-Z0-9_:])."""
    return "slipstream_" + _INVALID.sub("_", metric).strip("_")


class PrometheusExporter:
    """Serves this process's latest metrics on http://host:port/metrics until `close`."""

    def __init__(self, host: str, port: int, process: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        self.process = process
        self.gauges: dict[str, Any] = {}
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot serve Prometheus metrics on {host}:{port} ({e.strerror}); change monitor.prometheus_port",
            ) from e
        self.port = self.server.server_port

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """Set the gauges of every finite numeric metric (other values are skipped) and the step."""
        for name, value in {"step": step, **metrics}.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            key = gauge_name(name)
            gauge = self.gauges.get(key)
            if gauge is None:
                from prometheus_client import Gauge

                gauge = self.gauges[key] = Gauge(
                    key, f"Slipstream metric {name!r}", ["process"], registry=self.registry
                )
            gauge.labels(process=self.process).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
