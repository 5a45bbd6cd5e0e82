"""Trainer process: consumes the orchestrator's batches, steps the optimizer, publishes weights (slipstream.weights)."""
