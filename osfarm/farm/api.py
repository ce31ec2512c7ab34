"""The farm's REST API: leases, steps, observations and an OSWorld-compatible guest passthrough.

``create_app(settings)`` builds the FastAPI app; its lifespan makes the provider, starts the
lease pool and closes both on shutdown. Every route but ``/healthz`` needs the farm token (see
:mod:`osfarm.farm.auth`). Errors always answer ``{"detail": "<message>"}``: a pool error with
its own status, bad input with 400/422 naming the field, a crashed guest with 410.

``FarmServer`` runs the app under uvicorn in a background thread on a loopback port; the demo
command and the tests use it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any
from urllib.parse import quote

import httpx
from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import osfarm
from osfarm.config import FarmSettings
from osfarm.desktop.actions import ActionError, check_on_screen, parse_action
from osfarm.desktop.models import ImageFormat, Observation, ObserveOptions, StepRequest, StepResult
from osfarm.farm.auth import TokenAuth
from osfarm.farm.errors import ApiError, CapacityError, FarmError, describe
from osfarm.farm.state import FarmState, OwnerHeader
from osfarm.farm.schemas import (
    DESKTOP_ERRORS,
    ErrorBody,
    HeartbeatRequest,
    Healthz,
    LeaseInfo,
    LeaseRequest,
    PoolStatus,
)

log = logging.getLogger("osfarm.farm.api")

# Guest calls that may legitimately block for long (OSWorld's /setup/open_file waits up to 30
# min for a window; /execute runs commands for up to 120 s): no read timeout beyond this.
PASSTHROUGH_TIMEOUT = httpx.Timeout(connect=10.0, read=1900.0, write=120.0, pool=60.0)
# Errors that mean "the guest did not answer at all" (socket gone, process died mid-reply).
_UNREACHABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Hop-by-hop or recomputed headers that must not be copied between the two connections.
_REQUEST_HEADERS = ("content-type", "content-length", "accept", "content-encoding")
_RESPONSE_HEADERS = ("content-type", "content-length", "content-encoding", "content-disposition", "cache-control")

def _lease_info(lease: Any) -> LeaseInfo:
    width, height = lease.screen
    return LeaseInfo(
        id=lease.id,
        desktop_id=lease.desktop_id,
        owner=lease.owner,
        created_at=lease.created_at,
        expires_at=lease.expires_at,
        ttl_s=lease.ttl_s,
        wait_s=getattr(lease, "wait_s", 0.0),
        screen={"width": width, "height": height},
        guest_url=f"/v1/desktops/{lease.id}/guest",
        provider=getattr(lease, "provider", "sandbox"),
        image=getattr(lease, "image", None),
    )


def _format_validation(errors: list[dict[str, Any]]) -> tuple[int, str]:
    """One readable line per error, each starting with the dotted field path."""
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


def _observe_step(seconds: float) -> None:
    try:
        from osfarm.farm.metrics import STEP_SECONDS
    except ImportError:  # metrics module not present: nothing to record
        return
    STEP_SECONDS.observe(seconds)


def create_app(settings: FarmSettings, provider: Any = None) -> FastAPI:
    """The farm app. ``provider`` defaults to ``make_provider(settings)`` at startup; either
    way the app closes it at shutdown."""
    settings.ensure_token()
    state = FarmState(settings, provider)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        log.info("farm ready: provider=%s pool_min=%d pool_max=%d", settings.provider, settings.pool_min, settings.pool_max)
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
    app.add_middleware(TokenAuth, token=settings.token, public=("/healthz",))

    # ---- error mapping: always {"detail": str}, never a 500 for bad input ----

    @app.exception_handler(FarmError)
    async def _farm_error(request: Request, exc: FarmError) -> JSONResponse:
        headers = None
        if isinstance(exc, CapacityError):
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, detail = _format_validation(list(exc.errors()))
        return JSONResponse({"detail": detail}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}; see /docs"
        elif exc.status_code == 405:
            detail = f"method {request.method} not allowed on {request.url.path}; see /docs"
        return JSONResponse({"detail": str(detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {describe(exc)}"}, status_code=500)

    # ---- helpers shared by the desktop routes ----

    guest_call = state.guest_call

    def get_lease(lease_id: str, owner: str | None) -> Any:
        return state.require_pool().get(lease_id, owner)

    # ---- routes ----

    @app.get("/healthz", response_model=Healthz, tags=["farm"], summary="Liveness (no auth)")
    async def healthz() -> Healthz:
        return Healthz(
            version=osfarm.__version__,
            provider=settings.provider,
            uptime_s=round(time.time() - state.started_at, 3),
            ready=state.pool is not None,
        )

    @app.get("/v1/pool", response_model=PoolStatus, tags=["farm"], summary="Pool status",
             responses={401: {"model": ErrorBody}})
    async def pool_status() -> PoolStatus:
        return PoolStatus.model_validate(state.require_pool().status())

    @app.get("/metrics", tags=["farm"], summary="Prometheus metrics",
             response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from osfarm.farm.metrics import REGISTRY

        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/desktops", status_code=201, response_model=LeaseInfo, tags=["desktops"],
              summary="Lease a desktop",
              responses={**DESKTOP_ERRORS, 429: {"model": ErrorBody, "description": "every desktop is leased; retry after Retry-After"},
                         503: {"model": ErrorBody, "description": "desktops cannot be started"}})
    async def lease_desktop(req: Annotated[LeaseRequest | None, Body()] = None) -> LeaseInfo:
        req = req or LeaseRequest()
        lease = await state.require_pool().lease(owner=req.owner, ttl_s=req.ttl_s, wait_s=req.wait_s)
        return _lease_info(lease)

    @app.get("/v1/desktops/{lease_id}", response_model=LeaseInfo, tags=["desktops"], summary="Lease details",
             responses=DESKTOP_ERRORS)
    async def get_desktop(lease_id: str, owner: OwnerHeader = None) -> LeaseInfo:
        return _lease_info(get_lease(lease_id, owner))

    @app.post("/v1/desktops/{lease_id}/step", response_model=StepResult, tags=["desktops"],
              summary="Run actions, optionally observe", responses={**DESKTOP_ERRORS, 502: {"model": ErrorBody}})
    async def step(lease_id: str, req: StepRequest, owner: OwnerHeader = None) -> Response:
        lease = get_lease(lease_id, owner)
        width, height = lease.screen
        # Validate every action before any runs, so a bad batch has no partial effect.
        for i, raw in enumerate(req.actions):
            try:
                action = parse_action(raw, f"actions.{i}")
                check_on_screen(action, width, height, f"actions.{i}")
            except ActionError as e:
                raise ApiError(422, str(e)) from None
        timeout_s = req.code_timeout * len(req.actions) + 60.0
        t0 = time.perf_counter()
        r = await guest_call(lease, "POST", "/v1/step", json=req.model_dump(mode="json"), timeout_s=timeout_s)
        _observe_step(time.perf_counter() - t0)
        # The guest already speaks StepResult: pass its bytes through rather than re-encode them.
        return Response(r.content, media_type="application/json")

    @app.get("/v1/desktops/{lease_id}/observation", response_model=Observation, tags=["desktops"],
             summary="Screenshot, windows, cursor and a11y tree in one call", responses=DESKTOP_ERRORS)
    async def observation(lease_id: str, opts: Annotated[ObserveOptions, Query()], owner: OwnerHeader = None) -> Response:
        lease = get_lease(lease_id, owner)
        params = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in opts.model_dump().items()}
        r = await guest_call(lease, "GET", "/v1/observation", params=params)
        return Response(r.content, media_type="application/json")

    @app.get("/v1/desktops/{lease_id}/screenshot", tags=["desktops"], summary="Raw screenshot image",
             response_class=Response,
             responses={**DESKTOP_ERRORS, 200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}}})
    async def screenshot(
        lease_id: str,
        format: Annotated[ImageFormat, Query()] = "png",
        scale: Annotated[float, Query(gt=0.0, le=1.0)] = 1.0,
        quality: Annotated[int, Query(ge=1, le=100)] = 80,
        owner: OwnerHeader = None,
    ) -> Response:
        lease = get_lease(lease_id, owner)
        r = await guest_call(lease, "GET", "/v1/screenshot", params={"format": format, "scale": str(scale), "quality": str(quality)})
        size = {k: r.headers[k] for k in ("x-image-width", "x-image-height") if k in r.headers}
        return Response(r.content, media_type=r.headers.get("content-type", f"image/{format}"), headers=size)

    @app.post("/v1/desktops/{lease_id}/heartbeat", response_model=LeaseInfo, tags=["desktops"],
              summary="Extend the lease", responses=DESKTOP_ERRORS)
    async def heartbeat(lease_id: str, req: Annotated[HeartbeatRequest | None, Body()] = None, owner: OwnerHeader = None) -> LeaseInfo:
        get_lease(lease_id, owner)
        lease = await state.require_pool().heartbeat(lease_id, req.ttl_s if req else None)
        return _lease_info(lease)

    @app.delete("/v1/desktops/{lease_id}", status_code=204, response_class=Response, tags=["desktops"],
                summary="Release the lease (the desktop is reset in the background)", responses=DESKTOP_ERRORS)
    async def release(lease_id: str, owner: OwnerHeader = None) -> Response:
        lease = get_lease(lease_id, owner)
        await state.require_pool().release(lease_id)
        await state.drop_guest(lease.desktop_id)  # the reset may give the desktop a new socket
        return Response(status_code=204)

    async def guest_passthrough(lease_id: str, path: str, request: Request, owner: OwnerHeader = None) -> Response:
        lease = get_lease(lease_id, owner)
        headers = {k: request.headers[k] for k in _REQUEST_HEADERS if k in request.headers}
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        url = "/" + quote(path, safe="/:@!$&'()*+,;=-._~")
        if request.url.query:
            url += "?" + request.url.query
        client = state.guest(lease).client
        # Stream both ways: uploads and recordings can be large, and a chunked copy keeps
        # the farm's memory flat.
        req = client.build_request(
            request.method, url, headers=headers, content=request.stream() if has_body else None,
            timeout=PASSTHROUGH_TIMEOUT,
        )
        try:
            r = await client.send(req, stream=True)
        except _UNREACHABLE as e:
            raise await state.unreachable(lease, e) from None
        except httpx.TimeoutException as e:
            raise ApiError(504, f"the desktop's guest server did not answer in time ({describe(e)})") from None
        out = {k: r.headers[k] for k in _RESPONSE_HEADERS if k in r.headers}
        return StreamingResponse(r.aiter_raw(), status_code=r.status_code, headers=out, background=BackgroundTask(r.aclose))

    # One route per method so each gets its own OpenAPI operation id.
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
        app.add_api_route(
            "/v1/desktops/{lease_id}/guest/{path:path}", guest_passthrough, methods=[method],
            operation_id=f"guest_passthrough_{method.lower()}", tags=["guest passthrough"],
            summary=f"{method} to the guest's OSWorld-compatible route `/{{path}}`",
            response_class=Response, responses=DESKTOP_ERRORS, include_in_schema=method in ("GET", "POST"),
        )  # fmt: skip

    # Imported late: task_routes imports this module.
    from osfarm.farm.task_routes import add_task_routes

    add_task_routes(app, state, settings)

    return app


class FarmServer:
    """The farm under uvicorn in a background thread, on a loopback socket bound up front.

    ``start()`` returns once the API answers (and, by default, the pool is warm); ``stop()``
    runs the lifespan shutdown, which destroys every desktop. Thread-safe to start/stop from
    one controlling thread.
    """

    def __init__(self, settings: FarmSettings, provider: Any = None, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        self.settings = settings.ensure_token()
        self.app = create_app(settings, provider)
        self.state: FarmState = self.app.state.farm
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, log_config=None, lifespan="on"))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def token(self) -> str:
        return self.settings.token

    def start(self, timeout: float = 120.0, warm: bool = True) -> str:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="osfarm-farm", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                err = self.state.start_error
                self.stop()
                raise RuntimeError(f"the farm did not start: {err or 'timed out'}")
            time.sleep(0.02)
        if warm and self.state.pool is not None and self.state.loop is not None:
            fut = asyncio.run_coroutine_threadsafe(self.state.pool.wait_warm(max(1.0, deadline - time.monotonic())), self.state.loop)
            try:
                fut.result(timeout=max(1.0, deadline - time.monotonic()) + 5)
            except BaseException:
                self.stop()
                raise
        return self.url

    def stop(self, timeout: float = 60.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "FarmServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
