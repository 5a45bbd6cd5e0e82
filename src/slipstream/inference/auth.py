"""Token check for vLLM's admin endpoints (pause, resume, weight loading, cache reset), loaded into the server
with `--middleware`. vLLM's own `--api-key` guards only /v1, so without this anyone who can reach the port
could swap the policy's weights."""

import asyncio
import hmac
import os
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from slipstream.inference.admin_token import (
    HANDLED_MS_HEADER,
    HEADER,
    LOOP_LAG_MS_HEADER,
    PAUSED_MS_HEADER,
    TOKEN_ENV,
    admin_headers,
)
from slipstream.utils.loop_lag import LoopLag

__all__ = ["AdminTokenMiddleware", "admin_headers", "is_open_path"]
# Read-only and inference routes stay open (/v1 can be guarded separately with vLLM's --api-key).
OPEN_PREFIXES = ("/v1/", "/health", "/ping", "/version", "/metrics", "/tokenize", "/detokenize", "/load")


def is_open_path(path: str) -> bool:
    return path.startswith(OPEN_PREFIXES) or path in ("/v1", "/")


class AdminTokenMiddleware:
    """ASGI middleware: every route outside OPEN_PREFIXES needs the header `X-Slipstream-Admin-Token: <token>`."""

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"{TOKEN_ENV} is not set: the admin endpoints would be open; set it to a secret")
        self.app = app
        self.expected = token.encode()
        self.lag = LoopLag()
        self._sampling: asyncio.Future | None = None
        """The server loop's lateness, sampled from the first request on (the loop runs by then)."""
        self._paused_at: float | None = None
        """When the last /pause reached the server (its handler started), until a /resume replies."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._sampling is None:
            self._sampling = asyncio.ensure_future(self.lag.run())
        if scope["type"] in ("http", "websocket") and not is_open_path(scope["path"]):
            given = dict(scope["headers"]).get(HEADER.lower().encode(), b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse({"error": "admin endpoint: missing or wrong admin token"}, status_code=401)
                await response(scope, receive, send)
                return
            start = time.perf_counter()
            if scope["path"] == "/pause" and self._paused_at is None:
                self._paused_at = start
            await self.app(scope, receive, self._timed(send, start, resume=scope["path"] == "/resume"))
            return
        await self.app(scope, receive, send)

    def _timed(self, send: Send, start: float, resume: bool = False) -> Send:
        """`send` adding the admin reply's diagnostic headers: the call's milliseconds and the loop's lateness; on
        /resume's reply, the time since /pause reached the server (the engine's pause)."""

        async def timed_send(message) -> None:
            if message["type"] == "http.response.start":
                now = time.perf_counter()
                headers = [(HANDLED_MS_HEADER.lower().encode(), f"{(now - start) * 1e3:.3f}".encode())]
                if (lag := self.lag.take()) is not None:
                    headers.append((LOOP_LAG_MS_HEADER.lower().encode(), f"{lag[0] * 1e3:.3f}".encode()))
                if resume and self._paused_at is not None:
                    headers.append((PAUSED_MS_HEADER.lower().encode(), f"{(now - self._paused_at) * 1e3:.3f}".encode()))
                    self._paused_at = None
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        return timed_send
