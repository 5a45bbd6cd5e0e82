"""Slipstream: asynchronous reinforcement learning for post-training LLMs."""

__version__ = "0.1.0"
