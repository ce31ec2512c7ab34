"""Bearer-token auth as a pure ASGI middleware, for every osfarm server (farm API, guest server).

A middleware (rather than a FastAPI dependency) also covers ``/docs``, ``/openapi.json``,
``/metrics`` and unknown routes, so nothing is served before the token is checked, except the
paths in ``public``. Tokens are compared in constant time.

``basic=True`` also accepts ``Authorization: Basic base64(<any user>:<token>)``: the farm wants
it because OSWorld's ``PythonController`` uses ``requests``, which turns the userinfo of
``http://osfarm:TOKEN@host/...`` into Basic auth, and because a browser can then open ``/docs``
after a login prompt. The guest server takes Bearer only.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def check_authorization(header: str | None, token: str, basic: bool = False) -> str | None:
    """None if the ``Authorization`` header carries ``token``; otherwise why not (the 401 detail)."""
    also = " (or HTTP Basic auth with the token as password)" if basic else ""
    if not header:
        return f"missing bearer token: send 'Authorization: Bearer <token>'{also}"
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    scheme = scheme.lower()
    if scheme == "bearer":
        given = value
    elif scheme == "basic" and basic:
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return "malformed Basic credentials"
        _, sep, given = decoded.partition(":")
        if not sep:
            return "malformed Basic credentials: expected user:token"
    else:
        return f"unsupported auth scheme {scheme!r}: use 'Authorization: Bearer <token>'{also}"
    if not secrets.compare_digest(given.encode(), token.encode()):
        return "invalid token"
    return None


class BearerAuth:
    """Answers 401 (JSON ``{"detail": ...}``) to every HTTP request without the token."""

    def __init__(self, app: ASGIApp, token: str, public: Iterable[str] = (), basic: bool = False,
                 realm: str | None = None):
        if not token:
            raise ValueError("the token must not be empty")
        self.app = app
        self.token = token
        self.public = frozenset(public)
        self.basic = basic
        param = f' realm="{realm}"' if realm else ""
        # Bearer for API clients; Basic makes browsers prompt (any user, token as password).
        self.challenges = [(b"www-authenticate", f"Bearer{param}".encode())]
        if basic:
            self.challenges.append((b"www-authenticate", f"Basic{param}".encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.public:
            await self.app(scope, receive, send)
            return
        header = None
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                header = v.decode("latin-1")
                break
        problem = check_authorization(header, self.token, self.basic)
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": problem}).encode()
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *self.challenges],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})
