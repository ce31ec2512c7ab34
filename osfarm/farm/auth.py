"""Token auth for the farm API, as a pure ASGI middleware.

Accepted credentials, both compared in constant time against the farm token:

* ``Authorization: Bearer <token>`` (the native clients);
* ``Authorization: Basic base64(<any user>:<token>)``, because OSWorld's ``PythonController``
  uses ``requests``, which turns the userinfo of ``http://osfarm:TOKEN@host/...`` into Basic
  auth, and because a browser can then open ``/docs`` after a login prompt.

A middleware (rather than a FastAPI dependency) also covers ``/docs``, ``/openapi.json``,
``/metrics`` and unknown routes, so nothing is served before the token is checked, except the
paths in ``public``.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from collections.abc import Iterable
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def check_authorization(header: str | None, token: str) -> str | None:
    """None if ``header`` carries ``token``; otherwise why not (used as the 401 detail)."""
    if not header:
        return "missing token: send 'Authorization: Bearer <token>' (or HTTP Basic auth with the token as password)"
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    scheme = scheme.lower()
    if scheme == "bearer":
        given = value
    elif scheme == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return "malformed Basic credentials"
        _, sep, given = decoded.partition(":")
        if not sep:
            return "malformed Basic credentials: expected user:token"
    else:
        return f"unsupported auth scheme {scheme!r}: use Bearer (or Basic with the token as password)"
    if not secrets.compare_digest(given.encode(), token.encode()):
        return "invalid token"
    return None


class TokenAuth:
    """ASGI middleware answering 401 (JSON ``{"detail": ...}``) to requests without the token."""

    def __init__(self, app: ASGIApp, token: str, public: Iterable[str] = ("/healthz",)):
        if not token:
            raise ValueError("the farm token must not be empty")
        self.app = app
        self.token = token
        self.public = frozenset(public)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.public:
            await self.app(scope, receive, send)
            return
        header = None
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                header = v.decode("latin-1")
                break
        problem = check_authorization(header, self.token)
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": problem}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    # Bearer for API clients; Basic makes browsers prompt (any user, token as password).
                    (b"www-authenticate", b'Bearer realm="osfarm"'),
                    (b"www-authenticate", b'Basic realm="osfarm"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
