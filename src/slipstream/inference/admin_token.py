"""The admin token shared by the inference server and its admin clients (dependency-free: the orchestrator uses it).

`slipstream rl` and `slipstream eval` create one per run and hand it to their children through the environment.
"""

import os
import secrets

TOKEN_ENV = "SLIPSTREAM_ADMIN_TOKEN"
HEADER = "X-Slipstream-Admin-Token"  # its own header, so it never collides with vLLM's --api-key Bearer token
HANDLED_MS_HEADER = "X-Slipstream-Handled-Ms"
"""Reply header of every admin call (inference/auth.py): milliseconds from the request's arrival at the server to its
reply, so the orchestrator can tell the server's time on a call (a pause, a load) from the time spent reaching it."""
PAUSED_MS_HEADER = "X-Slipstream-Paused-Ms"
"""Reply header of /resume (after a /pause): milliseconds from the /pause request's arrival at the server to this
reply, the time vLLM's engine held its requests. The way to the server, and the wait of /pause in its event loop,
are left out: vLLM's engine generates meanwhile (it runs in a process of its own)."""
LOOP_LAG_MS_HEADER = "X-Slipstream-Loop-Lag-Ms"
"""Reply header of every admin call: the server's event loop, its worst lateness (ms) since the admin call before
(utils/loop_lag.py); a busy loop delays the admin calls of a weight update as it delays streamed tokens."""


def admin_headers(token: str | None = None) -> dict[str, str]:
    """Headers an admin client sends (token from the environment by default)."""
    token = token if token is not None else os.environ.get(TOKEN_ENV, "")
    return {HEADER: token} if token else {}


def ensure_admin_token() -> str:
    """This process's admin token, created (and exported to children) if there is none yet."""
    if not os.environ.get(TOKEN_ENV):
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    return os.environ[TOKEN_ENV]
