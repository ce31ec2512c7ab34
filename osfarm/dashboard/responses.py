"""How the dashboard answers a page: HTML with its security headers, an error page for what is
not there, and :class:`PageRoute`, the route class of its routers, which turns a missing run (or
a dashboard without runs) raised by a handler or a dependency into that error page."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from osfarm.dashboard import pages
from osfarm.dashboard.confined import Refused
from osfarm.dashboard.state import NoRunsRoot, dashboard_of

# Headers of every dashboard page: no framing, no sniffing, no referrer to other sites (run names
# stay here; same-origin keeps the Origin header that the login form and the CSRF checks read).
PAGE_HEADERS = {
    "Content-Security-Policy": pages.CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def page(html: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(html, status_code=status, headers=PAGE_HEADERS)


def error_page(conn: HTTPConnection, status: int, message: str) -> HTMLResponse:
    frame = dashboard_of(conn).frame(conn)
    return page(pages.render("error.html", frame, status=status, message=message), status)


class PageRoute(APIRoute):
    """A dashboard route: a run path the runs root refuses (:class:`Refused`) or a run page of a
    dashboard without runs (:class:`NoRunsRoot`) is a 404 page naming why, not a 500. The app's
    own exception handlers are the farm's (JSON); this keeps the dashboard's answers HTML in
    both apps that serve it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_page(request: Request) -> Response:
            try:
                return await handle(request)
            except (Refused, NoRunsRoot) as e:
                return error_page(request, 404, str(e))

        return handle_page
