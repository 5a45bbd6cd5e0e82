"""Slipstream: asynchronous reinforcement learning for post-training LLMs."""


def __getattr__(name: str) -> str:
    # read on use: the version lives once, in pyproject.toml (the installed metadata), and `import slipstream` stays fast
    if name == "__version__":
        from slipstream.version import package_version

        return package_version()
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
