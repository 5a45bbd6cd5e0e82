"""The admin token shared by the inference server and its admin clients (dependency-free: the orchestrator uses it).

`slipstream rl` and `slipstream eval` create one per run and hand it to their children through the environment.
"""

import os
import secrets

TOKEN_ENV = "SLIPSTREAM_ADMIN_TOKEN"
HEADER = "X-Slipstream-Admin-Token"  # its own header, so it never collides with vLLM's --api-key Bearer token


def admin_headers(token: str | None = None) -> dict[str, str]:
    """Headers an admin client sends (token from the environment by default)."""
    token = token if token is not None else os.environ.get(TOKEN_ENV, "")
    return {HEADER: token} if token else {}


def ensure_admin_token() -> str:
    """This process's admin token, created (and exported to children) if there is none yet."""
    if not os.environ.get(TOKEN_ENV):
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    return os.environ[TOKEN_ENV]
