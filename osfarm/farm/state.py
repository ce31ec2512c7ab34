"""What the farm's routes share, and how a route gets it: ``FarmState`` plus FastAPI dependencies.

``create_app`` puts one ``FarmState`` on ``app.state.farm``; routes ask for it (or for the pool,
or for the lease named by the path's ``lease_id``, or for the caller) with the typed aliases below::

    @router.post("/v1/desktops/{lease_id}/thing")
    async def thing(lease: LeaseOf, state: State, who: CurrentPrincipal) -> ...: ...

The caller is the :class:`~osfarm.http.principals.Principal` of its token (put on
``request.state.principal`` by the auth middleware). ``LeaseOf`` enforces who sees which lease:
a client only its own (another client's lease is a 404, like an unknown id), an admin every
lease, a viewer none (403); ``Leaser`` is a caller that may lease desktops (admin or client).

Every dependency here is ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in a
worker thread, and the pool must only be touched from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
from fastapi import Depends, Header, Request
from starlette.requests import HTTPConnection

from osfarm.config import FarmSettings
from osfarm.farm.errors import ApiError, FarmError, describe
from osfarm.farm.guest_link import GuestLink, GuestReply, GuestTimeout, GuestUnreachable
from osfarm.farm.pool import Lease, LeasePool
from osfarm.farm.registry import FarmRegistry
from osfarm.http.errors import error_detail
from osfarm.http.principals import Principal
from osfarm.providers import make_provider
from osfarm.providers.base import GuestEndpoint, Provider

log = logging.getLogger("osfarm.farm.state")

# Default read timeout of a guest call; a step raises it with its actions' code timeouts.
GUEST_CALL_TIMEOUT_S = 120.0


@dataclass
class _GuestConn:
    endpoint: GuestEndpoint
    client: httpx.AsyncClient  # passthrough (streaming)
    link: GuestLink  # native hot path


class FarmState:
    """The provider, the pool, and one pooled connection pair per desktop.

    Only touched from the event loop's thread, so the dict needs no lock.
    """

    def __init__(self, settings: FarmSettings, provider: Provider | None = None):
        self.settings = settings
        # The farm owns the provider, given or made: it is closed at shutdown.
        self.provider: Provider | None = provider
        self.pool: LeasePool | None = None
        self.started_at = time.time()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.start_error: BaseException | None = None
        self._guests: dict[str, _GuestConn] = {}
        self._closing: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            if self.provider is None:
                self.provider = make_provider(self.settings)
            self.pool = LeasePool(self.provider, self.settings, registry=FarmRegistry(self.settings.state_dir))
            self.pool.lease_ended.append(self._lease_ended)
            await self.pool.start()
        except BaseException as e:
            self.start_error = e
            await self.close()
            raise

    async def close(self) -> None:
        for conn in list(self._guests.values()):
            await conn.client.aclose()
            await conn.link.aclose()
        self._guests.clear()
        pool, provider = self.pool, self.provider
        self.pool = self.provider = None
        if pool is not None:
            await pool.close()  # stops every desktop, then closes the provider
        elif provider is not None:
            await provider.close()

    def require_pool(self) -> LeasePool:
        if self.pool is None:
            raise ApiError(503, "the farm is starting or stopping", {"Retry-After": "1"})
        return self.pool

    # -- per-episode folders (what a task writes on the host) --------------------------------

    @property
    def episodes_root(self) -> Path:
        return self.settings.state_dir / "episodes"

    def episode_dir(self, lease_id: str, fresh: bool) -> Path:
        """``<state_dir>/episodes/<lease id>`` (0700): the one folder a task on this lease may
        write on the host (``execute`` output, fetched files). ``fresh`` empties it (a reset
        starts a new episode). Folders of leases that ended are removed on the way. Blocking:
        call it in a thread."""
        root = self.episodes_root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        live = self.pool.lease_ids() if self.pool is not None else set()
        for old in os.listdir(root):
            if old not in live and old != lease_id:
                shutil.rmtree(root / old, ignore_errors=True)
        d = root / lease_id  # lease ids are the pool's: letters and digits only
        if fresh:
            shutil.rmtree(d, ignore_errors=True)
        d.mkdir(exist_ok=True, mode=0o700)
        return d

    def drop_episode_dir(self, lease_id: str) -> None:
        shutil.rmtree(self.episodes_root / lease_id, ignore_errors=True)

    # -- connections to the guests ------------------------------------------------------------

    def guest(self, lease: Lease) -> _GuestConn:
        """The desktop's pooled connections; new ones when the desktop's endpoint changed (reset)."""
        conn = self._guests.get(lease.desktop_id)
        if conn is not None and conn.endpoint == lease.endpoint:
            return conn
        if conn is not None:
            loop = asyncio.get_running_loop()
            loop.create_task(conn.client.aclose())
            loop.create_task(conn.link.aclose())
        conn = _GuestConn(lease.endpoint, lease.endpoint.client(timeout=GUEST_CALL_TIMEOUT_S),
                          GuestLink(lease.endpoint))
        self._guests[lease.desktop_id] = conn
        return conn

    def _lease_ended(self, lease: Lease) -> None:
        """A lease ended (released, expired, its desktop crashed): its guest connections go too,
        unless the desktop already has newer ones (another endpoint, after its reset)."""
        conn = self._guests.get(lease.desktop_id)
        if conn is not None and conn.endpoint == lease.endpoint:
            del self._guests[lease.desktop_id]
            task = asyncio.get_running_loop().create_task(self._close(conn))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close(conn: _GuestConn) -> None:
        await conn.client.aclose()
        await conn.link.aclose()

    async def drop_guest(self, desktop_id: str) -> None:
        conn = self._guests.pop(desktop_id, None)
        if conn is not None:
            await conn.client.aclose()
            await conn.link.aclose()

    async def guest_call(
        self, lease: Lease, method: str, path: str, timeout_s: float = GUEST_CALL_TIMEOUT_S, **kw: Any
    ) -> GuestReply:
        """One native call to the lease's guest; a failed one raises the ApiError to answer."""
        try:
            r = await self.guest(lease).link.request(method, path, timeout_s=timeout_s, **kw)
        except GuestUnreachable as e:
            raise await self.unreachable(lease, e) from None
        except GuestTimeout as e:
            raise ApiError(504, f"the desktop's guest server did not answer in time ({e})") from None
        if r.status_code >= 400:
            raise guest_error(r)
        return r

    async def unreachable(self, lease: Lease, exc: Exception) -> ApiError:
        """Decide what a failed guest call means, and return the error to answer.

        A dropped keep-alive connection can race a request, so before declaring the desktop dead
        we ask its health route on a fresh connection: if it answers, the caller may retry (502);
        if not, the desktop is marked failed (the pool replaces it) and the lease is gone (410).
        A box over one of its limits (the provider says so) is failed even when its guest still
        answers, and the 410 names the limit.
        """
        await self.drop_guest(lease.desktop_id)
        probe = lease.endpoint.client(timeout=3.0)
        try:
            r = await probe.get("/v1/health")
            alive = r.status_code == 200
        except httpx.HTTPError:
            alive = False
        finally:
            await probe.aclose()
        known = None
        if self.pool is not None:
            ended = self.pool.ended_message(lease.id)
            if ended is not None:  # the pool ended the lease first (a limit hit): its reason
                return ApiError(410, ended)
            known = await self.pool.box_problem(lease.desktop_id)  # e.g. over its memory limit
        if alive and known is None:
            return ApiError(502, f"connection to the desktop's guest server dropped ({describe(exc)}); retry the call")
        reason = known or f"guest server unreachable: {describe(exc)}"
        log.warning("desktop %s of lease %s crashed: %s", lease.desktop_id, lease.id, reason)
        if self.pool is not None:
            try:
                self.pool.mark_failed(lease.id, reason)
            except FarmError:
                pass  # already released or replaced: the lease is gone either way
        return ApiError(410, f"desktop crashed ({reason}); the lease is gone, lease a new desktop")


def guest_error(r: httpx.Response | GuestReply) -> ApiError:
    """Map a guest's error reply to ours: its 4xx stay (bad input), anything else is 502."""
    detail = error_detail(r.content, fallback=r.reason_phrase)  # detail, message or error
    if 400 <= r.status_code < 500 and r.status_code not in (401, 403):
        return ApiError(r.status_code, detail)
    return ApiError(502, f"guest server error {r.status_code}: {detail}")


# -- dependencies ---------------------------------------------------------------------------------


async def get_farm_state(conn: HTTPConnection) -> FarmState:
    """The app's FarmState (set by ``create_app``); for HTTP routes and WebSockets alike."""
    state: FarmState = conn.app.state.farm
    return state


State = Annotated[FarmState, Depends(get_farm_state)]


async def get_pool(state: State) -> LeasePool:
    """The running pool; 503 (retry after 1 s) while the farm starts or stops."""
    return state.require_pool()


Pool = Annotated[LeasePool, Depends(get_pool)]

OwnerHeader = Annotated[
    str | None,
    Header(alias="X-Osfarm-Owner", description="if set, must match the lease's owner (403 otherwise)"),
]


async def get_principal(request: Request) -> Principal:
    """The caller (set by the auth middleware; every route but the public ones has one)."""
    principal = getattr(request.state, "principal", None)
    if not isinstance(principal, Principal):
        raise ApiError(401, "no authenticated caller")
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


async def get_leaser(principal: CurrentPrincipal) -> Principal:
    """The caller, if it may lease desktops and use them (admin, client); 403 for a viewer."""
    if not principal.can_lease:
        raise ApiError(403, f"token {principal.name!r} has the role {principal.role}: read-only, it cannot lease "
                            "or use desktops")
    return principal


Leaser = Annotated[Principal, Depends(get_leaser)]


async def get_lease(lease_id: str, pool: Pool, principal: Leaser, owner: OwnerHeader = None) -> Lease:
    """The live lease named by the path's ``lease_id``: 404 unknown or another client's, 410 ended,
    403 another owner's (``X-Osfarm-Owner``) or a read-only caller."""
    return pool.get(lease_id, owner, principal=None if principal.is_admin else principal.name)


LeaseOf = Annotated[Lease, Depends(get_lease)]
