"""The guest HTTP server that runs inside every desktop (FastAPI): :func:`create_app` assembles it.

Two sets of routes, all behind ``Authorization: Bearer <token>``:

* OSWorld-compatible routes (:mod:`osfarm.desktop.guest.osworld_routes`: ``/screenshot``,
  ``/execute``, ``/setup/...``): same paths, payloads and replies as OSWorld's in-VM Flask
  server, so its controllers can drive our desktops. Known OSWorld bugs are fixed:
  ``/run_bash_script`` runs once and answers; a command that times out answers 200 with
  ``status: "error"`` and ``returncode: -1`` (OSWorld answers 500, and its client then re-runs
  the side effects three times); ``/setup/open_file`` cannot block forever.
* Native ``/v1`` routes (:mod:`osfarm.desktop.guest.native_routes`, wire models in
  :mod:`osfarm.schema.guest`): structured actions through XTest in this process, pyautogui
  code in a long-lived interpreter, one-call observations.

Both are ``APIRouter`` modules; their shared state is the app's
:class:`~osfarm.desktop.session.guest_state.Desktop`, which they get through ``Depends``.

Bad input answers 400 (OSWorld routes) or 422 (``/v1`` bodies) with ``{"detail": "<field>:
<message>"}``; it never answers 500. Every X, AT-SPI and subprocess call is blocking and runs in
a worker thread; the event loop only parses and routes.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from osfarm.desktop.box.agent_world import AgentWorld
from osfarm.desktop.guest import guest_openapi, native_routes, osworld_routes
from osfarm.desktop.session.guest_state import Desktop
from osfarm.http.auth import BearerAuth
from osfarm.http.body_limit import BodyLimit, BodyRule
from osfarm.http.openapi import allowed_methods
from osfarm.http.principals import ADMIN_NAME, Principal, TokenTable

# Request bodies: actions and commands are small; uploads (a task's input files) may be large, and
# are spooled to disk by the form parser, never held in memory. Over the limit: 413.
MAX_BODY_BYTES = 16 << 20
MAX_UPLOAD_BYTES = 1 << 30


def create_app(
    token: str,
    display: str,
    *,
    home: str | None = None,
    alive: Callable[[], bool] | None = None,
    work_dir: str | None = None,
    warm_code_runner: bool = True,
    agent: AgentWorld | None = None,
    restart_buses: Callable[[], dict[str, float] | None] | None = None,
    session: str = "light",
) -> FastAPI:
    """The guest app for X display ``display``.

    ``alive`` (from the session launcher) says whether Xvfb still runs; ``work_dir`` holds
    recordings and temp scripts; ``home`` is the user's home (default ``$HOME``);
    ``restart_buses`` (from the session launcher) starts the agent's buses again after a warm reset;
    ``session`` is the desktop session that runs (``gnome`` or ``light``).
    """
    if not token:
        raise ValueError("a non-empty bearer token is required")
    home = home or os.environ.get("HOME") or str(Path.home())
    wdir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="osfarm-guest-"))
    wdir.mkdir(parents=True, exist_ok=True)
    desk = Desktop(display, home, wdir, alive, agent=agent)
    desk.restart_buses = restart_buses
    desk.session = session

    def open_capture() -> None:
        try:
            desk.capture  # noqa: B018 - made on first use
        except Exception:
            pass  # the first request that needs it reports the error

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The screen capture's X connections open now, while the server binds its socket and
        # the provider claims it (mss finds and loads its X libraries: ~50 ms), rather than in
        # the first request that asks for the screen: the provider's health check, which the
        # start waits for.
        threading.Thread(target=open_capture, daemon=True, name="open-capture").start()
        if warm_code_runner:
            # Hide the interpreter's pyautogui import behind idle time instead of the first step.
            desk.restart_runner(delay=0.5)
        yield
        await run_in_threadpool(desk.close)

    app = FastAPI(title="osfarm guest", version="1", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/v1/openapi.json")
    app.state.desktop = desk
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, setting="the guest's MAX_BODY_BYTES",
                       rules=[BodyRule(r"/setup/upload$", MAX_UPLOAD_BYTES, "the guest's MAX_UPLOAD_BYTES")])
    tokens = TokenTable()
    tokens.add_token(token, Principal(ADMIN_NAME, "admin"))
    app.state.tokens = tokens  # a warm reset re-arms the guest with a new token (native_routes)
    app.add_middleware(BearerAuth, tokens=tokens)  # added last = runs first: no body is read before the token

    # ---- error shapes

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        err: dict[str, Any] = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
        loc = [str(p) for p in err.get("loc", ())]
        if err.get("type") == "json_invalid":
            return JSONResponse({"detail": f"body: invalid JSON: {err.get('ctx', {}).get('error', err['msg'])}"}, 400)
        if len(loc) > 1 and loc[0] in ("body", "query", "path"):
            loc = loc[1:]
        field = ".".join(loc) or "body"
        return JSONResponse({"detail": f"{field}: {err['msg']}"}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # every method of the path (Starlette names the first route's only)
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request.app, request.url.path))}
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, 500)

    app.include_router(osworld_routes.router)
    app.include_router(native_routes.router)
    guest_openapi.install(app)
    return app


__all__ = ["create_app"]
