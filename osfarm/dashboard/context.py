"""The dashboard's shared state and what every route takes from it: :class:`Dashboard` (the runs
root, the farm's live hub, who controls which desktop) and the page :class:`~pages.Frame` of a
request (links, caller, CSRF token)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi.responses import HTMLResponse
from starlette.requests import HTTPConnection

from osfarm.dashboard import pages
from osfarm.dashboard.access import principal_of, session_csrf
from osfarm.dashboard.control import ControlRegistry
from osfarm.dashboard.links import ServerLinks
from osfarm.dashboard.live import LiveHub
from osfarm.dashboard.runs import RunsRoot
from osfarm.http.principals import TokenTable

# Headers of every dashboard page: no framing, no sniffing, no referrer to other sites (run names
# stay here; same-origin keeps the Origin header that the login form and the CSRF checks read).
PAGE_HEADERS = {
    "Content-Security-Policy": pages.CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass
class Dashboard:
    """One per app. ``runs``: the runs root (None: no run pages); ``farm``: whether this app is a
    farm (pool and desktop pages); ``tokens``: the token table for the login form (a farm's
    comes from its app: ``app.state.tokens``)."""

    runs: RunsRoot | None = None
    farm: bool = False
    tokens: TokenTable | None = None
    live_fps: float = 10.0
    control: ControlRegistry = field(default_factory=ControlRegistry)
    hub: LiveHub | None = None

    @staticmethod
    def for_runs(runs_dir: Path | None, **kw: Any) -> Dashboard:
        return Dashboard(runs=RunsRoot(runs_dir) if runs_dir is not None else None, **kw)

    def frame(self, conn: HTTPConnection) -> pages.Frame:
        return pages.Frame(
            links=ServerLinks(), principal=principal_of(conn), csrf=session_csrf(conn),
            has_runs=self.runs is not None, has_farm=self.farm,
            runs_root=str(self.runs.root) if self.runs is not None else "",
        )  # fmt: skip

    def token_table(self, conn: HTTPConnection) -> TokenTable | None:
        return self.tokens if self.tokens is not None else getattr(conn.app.state, "tokens", None)


def page(html: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(html, status_code=status, headers=PAGE_HEADERS)


def error_page(dash: Dashboard, conn: HTTPConnection, status: int, message: str) -> HTMLResponse:
    return page(pages.render("error.html", dash.frame(conn), status=status, message=message), status)
