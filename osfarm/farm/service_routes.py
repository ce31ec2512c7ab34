"""Routes about the farm itself: liveness (``/healthz``, the one route without a token), the
pool's status and the Prometheus metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import osfarm
from osfarm.farm.metrics import REGISTRY
from osfarm.farm.state import CurrentPrincipal, Pool, State
from osfarm.schema.pool import PoolStatus
from osfarm.schema.service import ErrorBody, Healthz, WhoAmI

router = APIRouter(tags=["farm"])

# Paths served without the farm token (the auth middleware is told so).
PUBLIC_PATHS = ("/healthz",)


@router.get("/healthz", response_model=Healthz, summary="Liveness (no auth)")
async def healthz(state: State) -> Healthz:
    return Healthz(
        version=osfarm.__version__,
        provider=state.settings.provider,
        uptime_s=round(time.time() - state.started_at, 3),
        ready=state.pool is not None,
    )


@router.get("/v1/pool", response_model=PoolStatus, summary="Pool status (lease ids: an admin sees all, a client "
            "its own, a viewer none)", responses={401: {"model": ErrorBody}})
async def pool_status(pool: Pool, principal: CurrentPrincipal) -> PoolStatus:
    status = pool.status()
    if not principal.is_admin:
        own = pool.lease_ids_of(principal.name) if principal.can_lease else set()
        for d in status["desktops"]:
            if d.get("lease_id") not in own:
                d["lease_id"] = None
    return PoolStatus.model_validate(status)


@router.get("/v1/whoami", response_model=WhoAmI, summary="The caller: name, role and limits of its token",
            responses={401: {"model": ErrorBody}})
async def whoami(principal: CurrentPrincipal, pool: Pool) -> WhoAmI:
    return WhoAmI(name=principal.name, role=principal.role, max_leases=principal.max_leases,
                  max_ttl_s=principal.max_ttl_s, leases=pool.leases_held(principal.name))


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
