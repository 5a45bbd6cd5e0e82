"""swe_fix environment: fix a bug in a generated Python repository with sandboxed bash and file tools."""

from slipstream.envs.swe_fix.env import SweFixEnv

__all__ = ["SweFixEnv"]
