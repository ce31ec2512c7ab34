"""The policy server: FastAPI app over a PolicyEngine.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/weights/reload``,
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's runtime LoRA API, with
``--enable-lora``), ``GET /health``, ``GET /metrics`` (Prometheus), OpenAPI at ``/docs``.
``stream: true`` answers with server-sent events of ``chat.completion.chunk`` objects as vLLM
sends them. Generation runs on one dedicated thread (requests queue for it; the event loop never
blocks); a reload or an adapter load runs in another thread and swaps the weights between
requests. Every response carries the policy version (JSON ``policy_version`` and the
``X-Policy-Version`` header), except those of LoRA adapters and of the adapter routes: as from
vLLM, none there.

The routes are ``APIRouter``s by what they are about, each getting what it needs through the
dependencies of :mod:`osfarm.policy.state` (``ServerState`` on ``app.state.policy``):

* :mod:`osfarm.policy.service_routes` ``/health``, ``/metrics``, ``/v1/models``
* :mod:`osfarm.policy.chat_routes`    ``/v1/chat/completions`` (JSON and server-sent events)
* :mod:`osfarm.policy.weight_routes`  ``/v1/weights/reload``, the LoRA adapter routes

This module builds the app: the token middleware, the error handlers (every error in the
OpenAI shape of :mod:`osfarm.policy.replies`) and the OpenAPI document's error answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from osfarm.http.auth import BearerAuth
from osfarm.http.openapi import allowed_methods, document_responses
from osfarm.policy import chat_routes, service_routes, weight_routes
from osfarm.policy.engine import PolicyEngine
from osfarm.policy.replies import ERROR_DOC, VERSION_HEADER, error_response
from osfarm.policy.sampling import LatencyModel
from osfarm.policy.state import PolicyMetrics, ServerState

__all__ = ["ERROR_DOC", "VERSION_HEADER", "PolicyMetrics", "ServerState", "create_app"]


def create_app(engine: PolicyEngine, latency: LatencyModel | None = None, token: str | None = None) -> FastAPI:
    """The server's app; with ``token`` every route but ``/health`` needs ``Authorization: Bearer
    <token>`` (vLLM's ``--api-key`` semantics, so the same clients work against both)."""
    app = FastAPI(
        lifespan=_lifespan,
        title="osfarm policy server",
        description="OpenAI-compatible chat completions (a subset) on a transformers VLM, with policy versions.",
        version="1",
    )
    if token:
        app.add_middleware(BearerAuth, token=token, public=service_routes.PUBLIC_PATHS)
    state = ServerState(engine, latency)
    state.metrics.version.set(engine.current.version)
    app.state.policy = state
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.include_router(service_routes.router)
    app.include_router(chat_routes.router)
    app.include_router(weight_routes.router)
    document_responses(app, _documented_errors, ERROR_DOC)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    state: ServerState = app.state.policy
    state.gen_pool.shutdown(wait=False, cancel_futures=True)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    state: ServerState = request.app.state.policy
    errors = exc.errors()
    parts = []
    for e in errors[:5]:
        parts.append(f"{_loc(tuple(e.get('loc', ())))}: {e.get('msg')}")
    param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
    state.metrics.requests.labels(request.url.path, "400").inc()
    detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
    body = exc.body if isinstance(exc.body, dict) else {}
    model = body.get("model") if isinstance(body.get("model"), str) else None
    version = None if request.url.path in weight_routes.LORA_ROUTES else state.version_of(model)
    return error_response(400, "; ".join(parts), param, version, detail)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # the OpenAI error shape for what Starlette refuses itself (an undecodable body, a method
    # or path the server does not have); a 405 names every method of the path
    response = error_response(exc.status_code, str(exc.detail), None)
    if exc.status_code == 405:
        response.headers["Allow"] = ", ".join(allowed_methods(request.app, request.url.path))
    return response


def _loc(loc: tuple) -> str:
    """pydantic's error location -> a JSON path (``messages[0].content``), without the 'body' prefix
    and without the names pydantic gives union members (``str``, ``list[...]``)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _documented_errors(path: str, method: str, op: dict[str, Any]) -> dict[int, str]:
    """What the routes answer besides their success, in the OpenAPI document (tests/test_contract.py
    holds the server to it): the OpenAI-style error body of ``error_response``."""
    out: dict[int, str] = {}
    if path not in service_routes.PUBLIC_PATHS:
        out[401] = "missing or wrong token (when the server has one: --api-key)"
    if method == "post":
        out[400] = ("invalid request; error.param names the field (also: the prompt and max_tokens exceed the "
                    "model's context, a weights path that is not a model)")
        out[404] = "no such model or adapter, or LoRA adapters are disabled (--enable-lora)"
        out[409] = "the request conflicts with the server's state (a reload or adapter change in progress)"
    if path == "/v1/chat/completions":
        out[500] = "generation failed (the error says why); the server stays up"
    return out
