"""Routes on leased desktops: lease, details, step, observation, screenshot, heartbeat, release.

The native calls go to the desktop's guest server over :class:`~osfarm.farm.guest_link.GuestLink`
(see :meth:`FarmState.guest_call`); the guest already speaks the step/observation models of
:mod:`osfarm.schema.guest`, so its JSON is passed through rather than re-encoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response

from osfarm.farm.error_responses import DESKTOP_ERRORS
from osfarm.farm.errors import ApiError
from osfarm.farm.metrics import LEASES_ABANDONED, STEP_SECONDS
from osfarm.farm.pool import Lease, LeasePool
from osfarm.farm.state import LeaseOf, Leaser, Pool, State
from osfarm.http.principals import Principal
from osfarm.schema.actions import ActionError, parse_actions
from osfarm.schema.guest import StepRequest, StepResult
from osfarm.schema.lease import ControlInfo, HeartbeatRequest, LeaseInfo, LeaseRequest
from osfarm.schema.observation import ImageFormat, Observation, ObserveOptions
from osfarm.schema.service import ErrorBody

router = APIRouter(tags=["desktops"])
log = logging.getLogger("osfarm.farm.api")
DISCONNECT_POLL_S = 0.25  # how often a waiting lease request looks for its client's hang-up


def lease_info(lease: Lease) -> LeaseInfo:
    width, height = lease.screen
    return LeaseInfo(
        id=lease.id,
        desktop_id=lease.desktop_id,
        owner=lease.owner,
        created_at=lease.created_at,
        expires_at=lease.expires_at,
        ttl_s=lease.ttl_s,
        wait_s=lease.wait_s,
        screen={"width": width, "height": height},
        guest_url=f"/v1/desktops/{lease.id}/guest",
        provider=lease.provider,
        image=lease.image,
        desktop=lease.desktop,
        client=lease.principal,
        control=[ControlInfo(by=c.by, started_at=c.started_at, ended_at=c.ended_at) for c in lease.control],
        cpu_s=lease.cpu_s,
        reset_mode=lease.reset_mode,
        reset_fallback=lease.reset_fallback,
    )


def allowed_ttl(principal: Principal, ttl_s: float | None, default_s: float) -> float | None:
    """The TTL to grant: the asked one within the caller's ``max_ttl_s`` (422 above it); none
    asked: the farm's default, capped at that maximum."""
    limit = principal.max_ttl_s
    if limit is None:
        return ttl_s
    if ttl_s is None:
        return min(default_s, limit)
    if ttl_s > limit:
        raise ApiError(422, f"body.ttl_s: {ttl_s:g} s is longer than the {limit:g} s token {principal.name!r} may "
                            "hold a lease (max_ttl_s); heartbeat to keep a lease longer")
    return ttl_s


@router.post("/v1/desktops", status_code=201, response_model=LeaseInfo, summary="Lease a desktop",
             responses={**DESKTOP_ERRORS,
                        429: {"model": ErrorBody, "description": "every desktop is leased (retry after Retry-After), "
                              "or the token's lease quota is reached (max_leases; no Retry-After)"},
                        503: {"model": ErrorBody, "description": "desktops cannot be started"}})
async def lease_desktop(request: Request, pool: Pool, state: State, principal: Leaser,
                        req: Annotated[LeaseRequest | None, Body()] = None) -> LeaseInfo:
    req = req or LeaseRequest()
    ttl = allowed_ttl(principal, req.ttl_s, state.settings.lease_ttl_s)
    lease = await while_connected(request, pool, pool.lease(owner=req.owner, ttl_s=ttl, wait_s=req.wait_s,
                                                            principal=principal.name, max_leases=principal.max_leases))
    lease.task_id = req.task_id
    return lease_info(lease)


async def while_connected(request: Request, pool: LeasePool, leasing: Coroutine[Any, Any, Lease]) -> Lease:
    """The lease ``leasing`` grants, unless the client hangs up first.

    uvicorn does not cancel a handler whose client went away, so without this a client that gave
    up waiting (its own timeout, a killed worker) would still be granted the next free desktop,
    which then sits leased to nobody until its TTL ends while live clients queue behind it. The
    wait is cancelled instead (the pool hands a desktop that was already on its way back to the
    ready set), and a lease granted in the same instant the client left is released at once."""
    task = asyncio.ensure_future(leasing)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            break
    lease = task.result() if not task.cancelled() else None
    if lease is not None and not await request.is_disconnected():
        return lease
    if lease is not None:
        await pool.release(lease.id)
    LEASES_ABANDONED.inc()
    log.info("lease request abandoned: the client went away while it waited")
    raise ApiError(499, "the client closed the connection before a desktop was leased")


@router.get("/v1/desktops/{lease_id}", response_model=LeaseInfo, summary="Lease details", responses=DESKTOP_ERRORS)
async def get_desktop(lease: LeaseOf) -> LeaseInfo:
    return lease_info(lease)


@router.post("/v1/desktops/{lease_id}/step", response_model=StepResult, summary="Run actions, optionally observe",
             responses={**DESKTOP_ERRORS, 502: {"model": ErrorBody}})
async def step(req: StepRequest, lease: LeaseOf, state: State) -> Response:
    try:
        parse_actions(req.actions, *lease.screen, strict=True)  # every action checked before any runs
    except ActionError as e:
        raise ApiError(422, str(e)) from None
    timeout_s = req.code_timeout * len(req.actions) + 60.0
    t0 = time.perf_counter()
    r = await state.guest_call(lease, "POST", "/v1/step", json=req.model_dump(mode="json"), timeout_s=timeout_s)
    STEP_SECONDS.observe(time.perf_counter() - t0)
    return Response(r.content, media_type="application/json")


@router.get("/v1/desktops/{lease_id}/observation", response_model=Observation,
            summary="Screenshot, windows, cursor and a11y tree in one call", responses=DESKTOP_ERRORS)
async def observation(opts: Annotated[ObserveOptions, Query()], lease: LeaseOf, state: State) -> Response:
    params = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in opts.model_dump().items()}
    r = await state.guest_call(lease, "GET", "/v1/observation", params=params)
    return Response(r.content, media_type="application/json")


@router.get("/v1/desktops/{lease_id}/screenshot", summary="Raw screenshot image", response_class=Response,
            responses={**DESKTOP_ERRORS, 200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}}})
async def screenshot(
    lease: LeaseOf,
    state: State,
    format: Annotated[ImageFormat, Query()] = "png",
    scale: Annotated[float, Query(gt=0.0, le=1.0)] = 1.0,
    quality: Annotated[int, Query(ge=1, le=100)] = 80,
) -> Response:
    r = await state.guest_call(lease, "GET", "/v1/screenshot",
                               params={"format": format, "scale": str(scale), "quality": str(quality)})
    size: dict[str, str] = {k: r.headers[k] for k in ("x-image-width", "x-image-height") if k in r.headers}
    return Response(r.content, media_type=r.headers.get("content-type", f"image/{format}"), headers=size)


@router.post("/v1/desktops/{lease_id}/heartbeat", response_model=LeaseInfo, summary="Extend the lease",
             responses=DESKTOP_ERRORS)
async def heartbeat(lease: LeaseOf, pool: Pool, principal: Leaser,
                    req: Annotated[HeartbeatRequest | None, Body()] = None) -> LeaseInfo:
    ttl = req.ttl_s if req else None
    if ttl is not None:
        ttl = allowed_ttl(principal, ttl, lease.ttl_s)
    return lease_info(await pool.heartbeat(lease.id, ttl))


@router.delete("/v1/desktops/{lease_id}", status_code=204, response_class=Response,
               summary="Release the lease (the desktop is reset in the background)", responses=DESKTOP_ERRORS)
async def release(lease: LeaseOf, pool: Pool, state: State) -> Response:
    await pool.release(lease.id)
    await state.drop_guest(lease.desktop_id)  # the reset may give the desktop a new socket
    await asyncio.to_thread(state.drop_episode_dir, lease.id)  # what its tasks wrote on the host
    return Response(status_code=204)
