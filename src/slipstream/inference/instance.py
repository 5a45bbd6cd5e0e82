"""Identity of one start of the inference server: every HTTP reply carries `X-Slipstream-Instance`, so a client
notices a server that restarted (and lost the loaded weights) even when no request of its own failed.

`slipstream inference` sets SLIPSTREAM_INFERENCE_INSTANCE to a fresh id before it starts vLLM, so every API
process of one start shares it; the middleware is loaded into vLLM with `--middleware`.
"""

import os
import uuid
from typing import Any

INSTANCE_HEADER = "X-Slipstream-Instance"
INSTANCE_ENV = "SLIPSTREAM_INFERENCE_INSTANCE"


def new_instance_id() -> str:
    return uuid.uuid4().hex


class InstanceIdMiddleware:
    """ASGI middleware adding `X-Slipstream-Instance: <id>` to every HTTP response (id from `instance`, else
    from SLIPSTREAM_INFERENCE_INSTANCE, else a fresh one)."""

    def __init__(self, app: Any, instance: str | None = None) -> None:
        self.app = app
        self.instance = instance or os.environ.get(INSTANCE_ENV) or new_instance_id()
        self._header = (INSTANCE_HEADER.lower().encode(), self.instance.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_instance(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_instance)
