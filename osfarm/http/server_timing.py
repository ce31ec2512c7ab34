"""``Server-Timing: app;dur=<ms>`` on every answer, as a pure ASGI middleware.

The duration runs from the moment the app gets the request (uvicorn has accepted the connection
and parsed the headers) to the moment the answer's headers go out. A client that times the whole
request subtracts it to see what the farm's handling did not cause: its own connection pool, the
TCP connect, the farm's accept queue and an event loop too busy to read the request
(bench/load.py prints that split). The header is the W3C Server Timing one, which browsers'
developer tools show as they are.
"""

from __future__ import annotations

import time

from osfarm.http.auth import ASGIApp, Message, Receive, Scope, Send

HEADER = b"server-timing"
METRIC = "app"


def server_ms(value: str | None) -> float | None:
    """The ``app`` duration in ms of a ``Server-Timing`` header value (None when absent)."""
    for part in (value or "").split(","):
        name, *params = (p.strip() for p in part.split(";"))
        if name != METRIC:
            continue
        for param in params:
            key, _, number = param.partition("=")
            if key.strip() == "dur":
                try:
                    return float(number)
                except ValueError:
                    return None
    return None


class ServerTiming:
    """Adds the ``app`` duration to HTTP answers; websockets and lifespan pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                dur = f"{METRIC};dur={(time.perf_counter() - t0) * 1000:.1f}".encode()
                message = {**message, "headers": [*message.get("headers", ()), (HEADER, dur)]}
            await send(message)

        await self.app(scope, receive, timed_send)
