"""Environments: task datasets plus reward functions, looked up by name in `slipstream.envs.registry`."""
