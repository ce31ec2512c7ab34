"""What the dashboard's routes share, and how a route gets it: :class:`Dashboard` plus FastAPI
dependencies, as the farm's routes get theirs (:mod:`osfarm.farm.state`).

Whoever builds the app puts one ``Dashboard`` on ``app.state.ui`` (``create_ui_app``, or the
farm's ``create_app`` from the :class:`~osfarm.farm.api.UiMount` it is handed); routes ask for what
they use with the typed aliases below::

    @router.get("/ui/thing")
    def thing(root: Runs, frame: PageFrame) -> Response: ...

The caller's token was checked by the auth middleware before any route runs; ``Caller`` is the
:class:`~osfarm.http.principals.Principal` it found. Every dependency is ``async def``, so it runs
on the event loop even for the run pages' plain ``def`` handlers (FastAPI runs those in a thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection

from osfarm.dashboard import pages
from osfarm.dashboard.access import principal_of, session_csrf
from osfarm.dashboard.control import ControlRegistry
from osfarm.dashboard.links import ServerLinks
from osfarm.dashboard.live import LiveHub, Target
from osfarm.dashboard.runs import RunsRoot
from osfarm.errors import OsfarmError
from osfarm.farm.state import FarmState, State
from osfarm.http.principals import Principal, TokenTable


class NoRunsRoot(OsfarmError, LookupError):
    """A run page of a dashboard started without a runs root (answered with a 404 page)."""


@dataclass
class Dashboard:
    """One per app. ``runs``: the runs root (None: no run pages); ``farm``: whether this app is a
    farm (pool and desktop pages); ``control``: who controls which desktop; ``hub``: the live
    capture of the farm's desktops, made at the first live page."""

    runs: RunsRoot | None = None
    farm: bool = False
    live_fps: float = 10.0
    control: ControlRegistry = field(default_factory=ControlRegistry)
    hub: LiveHub | None = None

    @staticmethod
    def for_runs(runs_dir: Path | None, farm: bool = False, live_fps: float = 10.0) -> Dashboard:
        return Dashboard(runs=RunsRoot(runs_dir) if runs_dir is not None else None, farm=farm, live_fps=live_fps)

    def frame(self, conn: HTTPConnection) -> pages.Frame:
        return pages.Frame(
            links=ServerLinks(), principal=principal_of(conn), csrf=session_csrf(conn),
            has_runs=self.runs is not None, has_farm=self.farm,
            runs_root=str(self.runs.root) if self.runs is not None else "",
        )  # fmt: skip

    def live_hub(self, farm: FarmState) -> LiveHub:
        """The farm's live capture (one per app: every page watching a desktop shares its loop)."""
        if self.hub is None:
            self.hub = LiveHub(partial(live_target, farm))
        return self.hub


def live_target(farm: FarmState, desktop_id: str) -> Target | None:
    """Where to capture a desktop from: None once it is gone, failed or stopping."""
    view = farm.pool.desktop(desktop_id) if farm.pool is not None else None
    if view is None or view.endpoint is None or view.screen is None or view.state in ("failed", "stopping"):
        return None
    return Target(view.endpoint, view.screen)


def dashboard_of(conn: HTTPConnection) -> Dashboard:
    """The app's Dashboard (for code outside a route's dependencies: the error page)."""
    dash: Dashboard = conn.app.state.ui
    return dash


# -- dependencies ---------------------------------------------------------------------------------


async def get_dashboard(conn: HTTPConnection) -> Dashboard:
    return dashboard_of(conn)


DashboardOf = Annotated[Dashboard, Depends(get_dashboard)]


async def get_frame(conn: HTTPConnection, dash: DashboardOf) -> pages.Frame:
    """What the page of this request gets: links, the caller, its CSRF token, what the app has."""
    return dash.frame(conn)


PageFrame = Annotated[pages.Frame, Depends(get_frame)]


async def get_runs(dash: DashboardOf) -> RunsRoot:
    """The runs root; :class:`NoRunsRoot` (a 404 page) on a dashboard without one."""
    if dash.runs is None:
        raise NoRunsRoot("this dashboard has no runs root (start it with --runs DIR)")
    return dash.runs


Runs = Annotated[RunsRoot, Depends(get_runs)]


async def get_caller(conn: HTTPConnection) -> Principal | None:
    """Who is looking (the auth middleware's principal); None only on a public path."""
    return principal_of(conn)


Caller = Annotated[Principal | None, Depends(get_caller)]


async def get_tokens(conn: HTTPConnection) -> TokenTable:
    """The tokens the login form accepts: the app's own table (the farm's, or ``osfarm ui``'s)."""
    tokens: TokenTable = conn.app.state.tokens
    return tokens


Tokens = Annotated[TokenTable, Depends(get_tokens)]


async def get_hub(dash: DashboardOf, farm: State) -> LiveHub:
    return dash.live_hub(farm)


Hub = Annotated[LiveHub, Depends(get_hub)]
