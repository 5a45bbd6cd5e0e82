"""`slipstream plan`: capacity planning of asynchronous RL deployments (GPU split, inference shape, staleness)
from a discrete-event simulation of the orchestrator's own scheduling rules and calibrated throughput models."""
