"""Who is looking at the dashboard, and the browser side of its auth.

The farm's one auth middleware (:class:`osfarm.http.auth.BearerAuth`) checks every ``/ui``
request, taking the token from ``Authorization`` (scripts) or from the dashboard's cookie
(browsers; accepted under ``/ui/`` only), and puts the caller's
:class:`~osfarm.http.principals.Principal` on the request. This module adds what a browser needs
on top: the login form that turns a token into that cookie (HttpOnly, SameSite=Strict, scoped
to ``/ui``), CSRF tokens for the forms, and same-origin checks for state-changing requests and
the live view's WebSocket.

Roles: every role may browse; the live view of a desktop is for admins and viewers, and for a
client on its own leases; only an admin takes control.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from osfarm.http.auth import BrowserLogin
from osfarm.http.principals import Principal

COOKIE = "osfarm_ui"
COOKIE_PATH = "/ui"
SESSION_S = 12 * 3600
PUBLIC_PATHS = ("/ui/login", "/ui/static/")  # served without a token (the login page, its CSS)
BROWSER_LOGIN = BrowserLogin(cookie=COOKIE, prefix="/ui/", public=PUBLIC_PATHS, login_path="/ui/login")


def principal_of(conn: HTTPConnection) -> Principal | None:
    """The caller the auth middleware found, or None."""
    state: Any = conn.scope.get("state") or {}
    p = state.get("principal") if isinstance(state, dict) else getattr(state, "principal", None)
    return p if isinstance(p, Principal) else None


def csrf_token(credential: str) -> str:
    """The CSRF token of a session: derived from its credential, so it needs no server state and
    cannot be computed by a page that does not hold the (HttpOnly) cookie."""
    return hmac.new(credential.encode(), b"osfarm-ui-csrf/1", hashlib.sha256).hexdigest()[:40]


def session_csrf(conn: HTTPConnection) -> str:
    cookie = conn.cookies.get(COOKIE)
    return csrf_token(cookie) if cookie else ""


def uses_cookie(conn: HTTPConnection) -> bool:
    """Whether the request is authenticated by the browser's cookie (an ambient credential),
    rather than by an ``Authorization`` header a script had to set on purpose."""
    return "authorization" not in conn.headers and COOKIE in conn.cookies


def csrf_ok(conn: HTTPConnection, given: str | None) -> bool:
    if not uses_cookie(conn):
        return True
    want = session_csrf(conn)
    return bool(given) and bool(want) and hmac.compare_digest(str(given), want)


def same_origin(conn: HTTPConnection) -> bool:
    """The request's ``Origin`` (or, lacking it, ``Referer``) names this host. A browser sends
    ``Origin`` on every POST and WebSocket handshake; a request without either is not from a
    page of another site (a script or curl), so it passes."""
    origin = conn.headers.get("origin") or conn.headers.get("referer")
    if not origin:
        return True
    if origin == "null":
        return False
    host = conn.headers.get("host", "")
    return urlsplit(origin).netloc.lower() == host.lower()


def may_watch(p: Principal, lease_principal: str | None, lease_owner: str | None) -> bool:
    """Admins and viewers watch every desktop; a client the desktops of its own leases."""
    if p.role in ("admin", "viewer"):
        return True
    return lease_principal is not None and lease_principal == p.name


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a path under /ui of this site, nothing else (no open redirect)."""
    if not target or not target.startswith("/ui/") or target.startswith("//") or "\\" in target:
        return "/ui/"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return "/ui/"
    return target


def cookie_header(value: str, secure: bool, max_age: int = SESSION_S) -> str:
    attrs = [f"{COOKIE}={value}", f"Path={COOKIE_PATH}", "HttpOnly", "SameSite=Strict", f"Max-Age={max_age}"]
    if secure:
        attrs.append("Secure")
    return "; ".join(attrs)
