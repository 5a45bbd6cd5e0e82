"""Env servers: an environment in its own process, one per environment, started and supervised by the orchestrator
and spoken to over ZMQ (wire.py), so third-party dependencies and crashes stay out of the orchestrator. Model turns
stay in the orchestrator (token-in/token-out): only messages, per-rollout state keys and rewards cross.

server.py runs in the child (`python -m slipstream.envs.server`); client.py is the orchestrator's side.
"""
