"""Routes that change the served weights: ``POST /v1/weights/reload`` (a new policy version) and
vLLM's runtime LoRA adapter API, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(with ``--enable-lora``; plain-text success and no policy version, as vLLM's).

A reload or an adapter load runs in a worker thread and swaps the weights between requests; a
checkpoint or adapter that does not load is a 400 and the old weights stay.

``router`` is included by :func:`osfarm.policy.server.create_app`; the routes get the engine and
the metrics through :mod:`osfarm.policy.state`'s dependencies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from osfarm.policy.engine import RequestError
from osfarm.policy.replies import VERSION_HEADER, error_response
from osfarm.policy.schemas import LoadLoRAAdapterRequest, ReloadRequest, ReloadResponse, UnloadLoRAAdapterRequest
from osfarm.policy.state import Engine, Metrics, PolicyMetrics

router = APIRouter()
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
log = logging.getLogger(__name__)


@router.post("/v1/weights/reload", response_model=ReloadResponse)
async def reload(req: ReloadRequest, engine: Engine, metrics: Metrics):
    route = "/v1/weights/reload"
    previous = engine.current.version
    t0 = time.perf_counter()
    try:
        new = await asyncio.to_thread(engine.reload, Path(req.path), req.version, req.force)
    except RequestError as e:
        metrics.reloads.labels("refused").inc()
        metrics.requests.labels(route, str(e.status)).inc()
        return error_response(e.status, str(e), e.field, engine.current.version)
    except Exception as e:  # noqa: BLE001 -- a broken checkpoint must not take the server down: old weights stay
        metrics.reloads.labels("failed").inc()
        metrics.requests.labels(route, "400").inc()
        return error_response(400, f"path: could not load {req.path}: {type(e).__name__}: {e}", "path",
                              engine.current.version)
    load_s = time.perf_counter() - t0
    metrics.reloads.labels("ok").inc()
    metrics.reload_s.observe(load_s)
    metrics.version.set(new.version)
    metrics.requests.labels(route, "200").inc()
    return JSONResponse(
        ReloadResponse(version=new.version, previous_version=previous, load_s=round(load_s, 3)).model_dump(),
        headers={VERSION_HEADER: str(new.version)},
    )


# ---- vLLM's runtime LoRA adapter API: plain-text success, no policy version -----------------


def _lora_disabled(metrics: PolicyMetrics, route: str) -> JSONResponse:
    metrics.requests.labels(route, "404").inc()
    return error_response(404, "LoRA adapters are disabled on this server: start it with --enable-lora", None)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(req: LoadLoRAAdapterRequest, engine: Engine, metrics: Metrics):
    """Load a PEFT LoRA adapter on top of the base model, served as model ``lora_name``."""
    route = "/v1/load_lora_adapter"
    if not engine.enable_lora:
        return _lora_disabled(metrics, route)
    t0 = time.perf_counter()
    try:
        await asyncio.to_thread(engine.load_adapter, req.lora_name, Path(req.lora_path), req.load_inplace)
    except RequestError as e:
        metrics.lora_loads.labels("refused").inc()
        metrics.requests.labels(route, str(e.status)).inc()
        return error_response(e.status, str(e), e.field)
    except Exception as e:  # noqa: BLE001 -- an adapter that does not fit must not take the server down
        log.warning("LoRA adapter %r from %s failed to load: %s: %s", req.lora_name, req.lora_path,
                    type(e).__name__, e)
        metrics.lora_loads.labels("failed").inc()
        metrics.requests.labels(route, "400").inc()
        message = f"lora_path: could not load the LoRA adapter {req.lora_path}: {type(e).__name__}: {e}"
        return error_response(400, message, "lora_path")
    metrics.lora_loads.labels("ok").inc()
    metrics.lora_load_s.observe(time.perf_counter() - t0)
    metrics.lora_adapters.set(len(engine.adapters))
    metrics.requests.labels(route, "200").inc()
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, engine: Engine, metrics: Metrics):
    """Stop serving a LoRA adapter (requests already running on it finish)."""
    route = "/v1/unload_lora_adapter"
    if not engine.enable_lora:
        return _lora_disabled(metrics, route)
    try:
        await asyncio.to_thread(engine.unload_adapter, req.lora_name)  # waits for a load in progress
    except RequestError as e:
        metrics.requests.labels(route, str(e.status)).inc()
        return error_response(e.status, str(e), e.field)
    metrics.lora_adapters.set(len(engine.adapters))
    metrics.requests.labels(route, "200").inc()
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
