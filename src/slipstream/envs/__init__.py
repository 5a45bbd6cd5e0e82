"""Environments: tasks, rewards and (for multi-turn and tool environments) the answers between model turns.

`registry.build_env` builds one by name; `rollout.run_rollout` plays any of them against a model function;
`tokens.build_samples` turns a rollout's model turns into token-exact training samples.
"""
