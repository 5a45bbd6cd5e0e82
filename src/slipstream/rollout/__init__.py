"""The one model-turn path of Slipstream, used by the orchestrator (training rollouts, online evaluation) and by
`slipstream eval`: streamed requests with per-token policy versions (streaming.py), single- and multi-turn model
turns with tools, context-length and stop handling (turns.py), whole replies for router replay (replies.py),
the token record of a rollout (record.py), and the generation client they send through (client.py)."""
