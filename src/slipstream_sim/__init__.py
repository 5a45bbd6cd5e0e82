"""Simulated vLLM server without a model, for tests and benchmarks: capacity, heavy-tailed latency, pause/resume,
weight versions, and chat completions streamed token by token like vLLM's. See app.py for the endpoints.
"""

from slipstream_sim.app import SimServer
from slipstream_sim.config import LatencyModel, SimConfig, latency_percentiles
from slipstream_sim.engine import RequestRecord, SimEngine
from slipstream_sim.policy import sim_logprob
from slipstream_sim.serve import serve_in_thread

__all__ = [
    "LatencyModel",
    "RequestRecord",
    "SimConfig",
    "SimEngine",
    "SimServer",
    "latency_percentiles",
    "serve_in_thread",
    "sim_logprob",
]
