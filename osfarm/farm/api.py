"""The farm's REST API: ``create_app(settings)`` assembles the route modules into one FastAPI app.

* :mod:`~osfarm.farm.service_routes`: ``/healthz``, ``/v1/pool``, ``/metrics``;
* :mod:`~osfarm.farm.desktop_routes`: leases, steps, observations, heartbeats, release;
* :mod:`~osfarm.farm.task_routes`: reset a desktop to an OSWorld task, evaluate it;
* :mod:`~osfarm.farm.passthrough_routes`: the OSWorld-compatible guest passthrough.

The app's lifespan makes the provider, starts the lease pool and closes both on shutdown; the
routes reach them through :mod:`osfarm.farm.state`. Every route but ``/healthz`` needs a token
(:class:`osfarm.http.auth.BearerAuth`, Bearer or Basic): the admin ``token`` or a client's
(:mod:`osfarm.http.principals`), whose principal the routes get as ``CurrentPrincipal``. Request
bodies are capped (:class:`osfarm.http.body_limit.BodyLimit`: 413 naming the limit). Errors always answer
``{"detail": "<message>"}``: a pool error with its own status, bad input with 400/422 naming the
field, a crashed guest with 410, never a bare 500 page.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import osfarm
from osfarm.config import FarmSettings
from osfarm.farm import desktop_routes, openapi, passthrough_routes, service_routes, task_routes
from osfarm.farm.errors import ApiError, CapacityError, FarmError, QuotaExceeded, describe
from osfarm.farm.state import FarmState
from osfarm.http.auth import BearerAuth, BrowserLogin
from osfarm.http.body_limit import BodyLimit, BodyRule
from osfarm.http.openapi import allowed_methods
from osfarm.http.principals import TokenTable
from osfarm.http.server_timing import ServerTiming
from osfarm.http.token_sources import build_token_table
from osfarm.providers.base import Provider

log = logging.getLogger("osfarm.farm.api")

# Marks a 429 that waiting does not cure (the token's lease quota); the client raises LeaseQuotaError.
QUOTA_HEADER = "X-Osfarm-Quota"


@dataclass(frozen=True)
class UiMount:
    """Pages the farm serves besides its API: the dashboard (``osfarm.dashboard``, which sits
    above the farm, so whoever builds the app hands it in: ``osfarm serve``). Its routers are
    included after the farm's own, behind the same auth middleware, which also takes the
    dashboard's login cookie under ``browser.prefix``. ``state``: what those routers' dependencies
    read from ``app.state.ui`` (the dashboard's own state; the farm does not look inside)."""

    routers: Sequence[APIRouter]
    browser: BrowserLogin
    state: object = None


def create_app(settings: FarmSettings, provider: Provider | None = None, ui: UiMount | None = None) -> FastAPI:
    """The farm app. ``provider`` defaults to ``make_provider(settings)`` at startup; either
    way the app closes it at shutdown. ``ui``: the dashboard's pages (none by default)."""
    settings.ensure_token()
    tokens = farm_tokens(settings)  # a bad token file fails here, before anything starts
    state = FarmState(settings, provider)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        log.info("farm ready: provider=%s pool_min=%d pool_max=%d", settings.provider, settings.pool_min,
                 settings.pool_max)
        try:
            yield
        finally:
            await state.close()
            log.info("farm stopped")

    app = FastAPI(
        title="osfarm",
        version=osfarm.__version__,
        description="Real Linux desktops as HTTP environments for GUI agents. "
        "Authenticate with `Authorization: Bearer <token>` (or HTTP Basic with the token as password).",
        lifespan=lifespan,
        # `curl -d '{...}'` sends no JSON content type; parse the body as JSON anyway.
        strict_content_type=False,
    )
    app.state.farm = state
    # Added first = runs inside: the token is checked before a byte of the body is read.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, setting="max_body_bytes (OSFARM_MAX_BODY_BYTES)",
                       rules=[BodyRule(passthrough_routes.PATH_REGEX, settings.max_upload_bytes,
                                       "max_upload_bytes (OSFARM_MAX_UPLOAD_BYTES)")])
    app.state.tokens = tokens  # the dashboard's login form checks tokens against the same table
    app.add_middleware(BearerAuth, tokens=tokens, public=service_routes.PUBLIC_PATHS, basic=True, realm="osfarm",
                       browser=ui.browser if ui else None)
    app.add_middleware(ServerTiming)  # added last = outermost: its duration covers auth and body checks too
    _add_error_handlers(app)
    openapi.install(app, service_routes.PUBLIC_PATHS)
    app.include_router(service_routes.router)
    app.include_router(desktop_routes.router)
    app.include_router(task_routes.router)
    app.include_router(passthrough_routes.router)
    if ui is not None:
        app.state.ui = ui.state
        for router in ui.routers:
            app.include_router(router)
    return app


def farm_tokens(settings: FarmSettings) -> TokenTable:
    """The admin token plus every client token of the settings (raises ConfigError naming a bad entry)."""
    return build_token_table(settings.token, settings.tokens, settings.tokens_file,
                             settings.client_max_leases, settings.client_max_ttl_s)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answers ``{"detail": str}``; bad input is never a 500."""

    @app.exception_handler(FarmError)
    async def _farm_error(request: Request, exc: FarmError) -> JSONResponse:
        headers = None
        if isinstance(exc, CapacityError):
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        elif isinstance(exc, QuotaExceeded):
            headers = {QUOTA_HEADER: f"max_leases={exc.max_leases}"}
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, detail = format_validation(list(exc.errors()))
        return JSONResponse({"detail": detail}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}; see /docs"
        headers = exc.headers
        if exc.status_code == 405:
            allowed = allowed_methods(request.app, request.url.path)
            detail = (f"method {request.method} not allowed on {request.url.path} "
                      f"(allowed: {', '.join(allowed)}); see /docs")
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}  # every route's methods, not the first's
        return JSONResponse({"detail": str(detail)}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {describe(exc)}"}, status_code=500)


def format_validation(errors: list[dict[str, Any]]) -> tuple[int, str]:
    """(status, detail): one readable part per error, each starting with the dotted field path;
    malformed JSON is a 400."""
    parts: list[str] = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ())]
        if err.get("type") == "json_invalid":
            pos = loc[1] if len(loc) > 1 else "?"
            why = (err.get("ctx") or {}).get("error", "JSON decode error")
            return 400, f"body: malformed JSON at character {pos}: {why}"
        if err.get("type") == "missing" and loc == ["body"]:
            parts.append("body: a JSON body is required")
            continue
        parts.append(f"{'.'.join(loc)}: {err.get('msg', 'invalid')}")
    return 422, "; ".join(parts) or "invalid request"
