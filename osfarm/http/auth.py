"""Bearer-token auth as a pure ASGI middleware, for every osfarm server (farm API, guest server).

A middleware (rather than a FastAPI dependency) also covers ``/docs``, ``/openapi.json``,
``/metrics`` and unknown routes, so nothing is served before the token is checked, except the
paths in ``public``. Tokens are never compared as such: the presented token's SHA-256 is looked
up (:class:`~osfarm.http.principals.TokenTable`), so timing reveals nothing about a token.

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
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from osfarm.http.principals import ADMIN_NAME, Principal, TokenTable

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
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


@dataclass(frozen=True)
class BrowserLogin:
    """Browser sessions under ``prefix`` (the farm's dashboard, ``/ui/``): there the token may
    also come from the HttpOnly cookie ``cookie`` (its value percent-encoded; the dashboard's login
    form sets it, scoped to that path) when no ``Authorization`` header is sent; ``public`` paths
    are served without a token (an entry ending in ``/`` is a prefix); and a browser asking for a
    page without a valid token is sent to ``login_path`` instead of getting a 401. The cookie is
    never a credential outside ``prefix``: the API takes headers only, so a page of another site
    cannot drive it with the browser's cookie."""

    cookie: str
    prefix: str
    public: tuple[str, ...] = ()
    login_path: str | None = None

    def is_public(self, path: str) -> bool:
        return any(path.startswith(p) if p.endswith("/") else path == p for p in self.public)


def _cookie(headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    for k, v in headers:
        if k == b"cookie":
            for part in v.decode("latin-1").split(";"):
                key, sep, value = part.strip().partition("=")
                if sep and key == name:
                    return unquote(value.strip().strip('"'))
    return None


class BearerAuth:
    """Answers 401 (JSON ``{"detail": ...}``) to every HTTP request and WebSocket handshake
    without a known token (a refused WebSocket is closed with code 4401 before it is accepted).

    ``token``: the one token (guest server); ``tokens``: a table of per-client tokens (farm);
    ``browser``: cookie sessions of the dashboard (:class:`BrowserLogin`).
    """

    def __init__(self, app: ASGIApp, token: str | None = None, public: Iterable[str] = (), basic: bool = False,
                 realm: str | None = None, tokens: TokenTable | None = None, browser: BrowserLogin | None = None):
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
        self.browser = browser
        param = f' realm="{realm}"' if realm else ""
        # Bearer for API clients; Basic makes browsers prompt (any user, token as password).
        self.challenges = [(b"www-authenticate", f"Bearer{param}".encode())]
        if basic:
            self.challenges.append((b"www-authenticate", f"Basic{param}".encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        browser = self.browser
        if scope["type"] not in ("http", "websocket") or path in self.public or (browser and browser.is_public(path)):
            await self.app(scope, receive, send)
            return
        header = None
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                header = v.decode("latin-1")
                break
        in_browser_area = browser is not None and path.startswith(browser.prefix)
        if header is None and browser is not None and in_browser_area:
            given = _cookie(scope.get("headers", ()), browser.cookie)
            problem = None if given else "not logged in: log in at " + (browser.login_path or browser.prefix)
        else:
            given, problem = presented_token(header, self.basic)
        if given is not None:
            principal = self.tokens.resolve(given)
            if principal is not None:
                scope.setdefault("state", {})["principal"] = principal
                await self.app(scope, receive, send)
                return
            problem = "invalid token"
        if scope["type"] == "websocket":
            await receive()  # the handshake's websocket.connect; closing now refuses it (HTTP 403)
            await send({"type": "websocket.close", "code": 4401, "reason": problem or "unauthorized"})
            return
        if in_browser_area and browser is not None and browser.login_path and _wants_page(scope):
            query = scope.get("query_string", b"").decode("latin-1")
            target = quote(path + (f"?{query}" if query else ""), safe="")
            await send({"type": "http.response.start", "status": 303,
                        "headers": [(b"location", f"{browser.login_path}?next={target}".encode()),
                                    (b"content-length", b"0"), (b"cache-control", b"no-store")]})
            await send({"type": "http.response.body", "body": b""})
            return
        body = json.dumps({"detail": problem}).encode()
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *self.challenges],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def _wants_page(scope: Scope) -> bool:
    """A browser navigating (GET of an HTML page), rather than a script or a sub-request."""
    if scope.get("method") != "GET":
        return False
    for k, v in scope.get("headers", ()):
        if k == b"accept":
            return b"text/html" in v
    return False
