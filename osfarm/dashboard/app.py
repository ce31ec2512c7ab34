"""The dashboard's apps: its routers (module-level ``APIRouter``s by subject: ``session_routes``,
``run_routes``, ``farm_routes``) and the :class:`~osfarm.dashboard.state.Dashboard` their
dependencies read from ``app.state.ui``, for a farm or on their own.

* On the farm (``osfarm serve``, same process, same auth): ``create_app(settings,
  ui=farm_ui(runs_dir))``: the pool and desktop pages, plus the run pages when a runs dir is
  configured (``ui_runs_dir``). The farm does not import the dashboard (it sits above the farm, see
  ``tests/test_layers.py``); whoever builds the farm hands it these routers.
* On its own (``osfarm ui --runs DIR``): :func:`create_ui_app`, the run pages behind the same
  auth middleware with their own token.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from fastapi import FastAPI

import osfarm
from osfarm.dashboard import farm_routes, run_routes, session_routes
from osfarm.dashboard.access import BROWSER_LOGIN
from osfarm.dashboard.state import Dashboard
from osfarm.farm.api import UiMount
from osfarm.http.auth import BearerAuth
from osfarm.http.principals import ADMIN_NAME, Principal, TokenTable


def farm_ui(runs_dir: Path | None = None, live_fps: float = 10.0) -> UiMount:
    """The dashboard of a farm app: ``create_app(settings, ui=farm_ui(settings.ui_runs_dir))``."""
    return mount(Dashboard.for_runs(runs_dir, live_fps=live_fps))


def mount(dash: Dashboard) -> UiMount:
    """The routers of ``dash`` for a farm app (tests and benches keep ``dash`` to look at its
    live hub: what is being captured)."""
    dash.farm = True
    return UiMount([session_routes.router, run_routes.router, farm_routes.router], BROWSER_LOGIN, state=dash)


def create_ui_app(runs_dir: Path, token: str | None = None, tokens: TokenTable | None = None) -> FastAPI:
    """The run pages alone, for ``osfarm ui``: ``token`` is an admin token (generated when
    neither it nor ``tokens`` is given; read it from ``app.state.token``)."""
    if tokens is None:
        token = token or secrets.token_urlsafe(24)
        tokens = TokenTable()
        tokens.add_token(token, Principal(ADMIN_NAME, "admin"))
    dash = Dashboard.for_runs(runs_dir)
    app = FastAPI(title="osfarm dashboard", version=osfarm.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.token = token
    app.state.tokens = tokens  # the login form's (get_tokens), as on a farm
    app.state.ui = dash
    app.add_middleware(BearerAuth, tokens=tokens, basic=False, realm="osfarm", browser=BROWSER_LOGIN)
    app.include_router(session_routes.router)
    app.include_router(run_routes.router)
    return app
