"""Bearer-token auth as a pure ASGI middleware, for every osfarm server (farm API, guest server).

A middleware (rather than a FastAPI dependency) also covers ``/docs``, ``/openapi.json``,
``/metrics`` and unknown routes, so nothing is served before the token is checked, except the
paths in ``public``. Tokens are compared in constant time.

With a :class:`~osfarm.http.principals.TokenTable` (the farm), each token names a
:class:`~osfarm.http.principals.Principal`, put in ``scope["state"]["principal"]`` (FastAPI:
``request.state.principal``) for the routes to decide what the caller may see and do. With a
single ``token`` (the guest server) the caller is ``Principal("admin", "admin")``.

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

from osfarm.http.principals import ADMIN_NAME, Principal, TokenTable

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def presented_token(header: str | None, basic: bool = False) -> tuple[str | None, str | None]:
    """(the token an ``Authorization`` header carries, None) or (None, why not: the 401 detail)."""
    also = " (or HTTP Basic auth with the token as password)" if basic else ""
    if not header:
        return None, f"missing bearer token: send 'Authorization: Bearer <token>'{also}"
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    scheme = scheme.lower()
    if scheme == "bearer":
        return value, None
    if scheme == "basic" and basic:
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None, "malformed Basic credentials"
        _, sep, given = decoded.partition(":")
        if not sep:
            return None, "malformed Basic credentials: expected user:token"
        return given, None
    return None, f"unsupported auth scheme {scheme!r}: use 'Authorization: Bearer <token>'{also}"


def check_authorization(header: str | None, token: str, basic: bool = False) -> str | None:
    """None if the ``Authorization`` header carries ``token``; otherwise why not (the 401 detail)."""
    given, problem = presented_token(header, basic)
    if given is None:
        return problem
    if not secrets.compare_digest(given.encode(), token.encode()):
        return "invalid token"
    return None


class BearerAuth:
    """Answers 401 (JSON ``{"detail": ...}``) to every HTTP request without a known token.

    ``token``: the one token (guest server); ``tokens``: a table of per-client tokens (farm).
    """

    def __init__(self, app: ASGIApp, token: str | None = None, public: Iterable[str] = (), basic: bool = False,
                 realm: str | None = None, tokens: TokenTable | None = None):
        if tokens is None:
            if not token:
                raise ValueError("the token must not be empty")
            tokens = TokenTable()
            tokens.add_token(token, Principal(ADMIN_NAME, "admin"))
        elif not len(tokens):
            raise ValueError("the token table must not be empty")
        self.app = app
        self.tokens = tokens
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
        given, problem = presented_token(header, self.basic)
        if given is not None:
            principal = self.tokens.resolve(given)
            if principal is not None:
                scope.setdefault("state", {})["principal"] = principal
                await self.app(scope, receive, send)
                return
            problem = "invalid token"
        body = json.dumps({"detail": problem}).encode()
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *self.challenges],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})
