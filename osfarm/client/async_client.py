"""The asyncio farm client: ``AsyncFarm`` and its leased ``AsyncRemoteDesktop``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx

from osfarm.client.errors import (
    FarmAPIError,
    FarmUnreachableError,
    ForeignLeaseError,
    LeaseGoneError,
    UnknownDesktopError,
    check_answer,
)
from osfarm.client.wire import (
    OWNER_HEADER,
    RETRY_S,
    Retries,
    guest_route,
    heartbeat_interval,
    lease_body,
    observe_params,
    resolve_farm,
    step_body,
    step_timeout,
)
from osfarm.http.source_address import async_transport
from osfarm.schema.actions import AgentAction
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionTiming, StepResult
from osfarm.schema.lease import LeaseInfo
from osfarm.schema.observation import Observation, ObserveOptions
from osfarm.schema.pool import PoolStatus
from osfarm.schema.service import Healthz, WhoAmI


class AsyncRemoteDesktop:
    """One leased desktop (async). ``close()`` releases it; also an async context manager."""

    def __init__(self, farm: AsyncFarm, info: LeaseInfo):
        self.farm = farm
        self.info = info
        self._headers = {OWNER_HEADER: info.owner} if info.owner else {}
        self._hb_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def screen(self) -> tuple[int, int]:
        return self.info.screen.width, self.info.screen.height

    def _path(self, suffix: str = "") -> str:
        return f"/v1/desktops/{self.info.id}{suffix}"

    async def step(self, actions: AgentAction | Sequence[AgentAction],
                   observe: ObserveOptions | dict[str, Any] | bool | None = None,
                   code_timeout: float = 30.0, timing: ActionTiming = DEFAULT_ACTION_TIMING) -> StepResult:
        """Run one action or a list of them (computer_13 dicts/models or pyautogui code) with
        OSWorld's semantics, each pause cut short once the screen answered (``timing="settle"``,
        the default: an observation taken at once shows the app's first answer, ``settle_s`` waits
        for the rest), paced exactly as OSWorld paces them (``"osworld"``), or as fast as the
        desktop takes them (``"fast"``)."""
        body = step_body(actions, observe, code_timeout, timing)
        r = await self.farm._request("POST", self._path("/step"), json=body, headers=self._headers,
                                     timeout=step_timeout(body))
        return StepResult.model_validate_json(r.content)

    async def observe(self, **opts: Any) -> Observation:
        """Screenshot/windows/cursor/a11y now; options as in ObserveOptions."""
        r = await self.farm._request("GET", self._path("/observation"), params=observe_params(opts),
                                     headers=self._headers)
        return Observation.model_validate_json(r.content)

    async def screenshot(self, fmt: str = "png", scale: float = 1.0, quality: int = 80) -> bytes:
        r = await self.farm._request("GET", self._path("/screenshot"), headers=self._headers,
                                     params={"format": fmt, "scale": scale, "quality": quality})
        return r.content

    async def heartbeat(self, ttl_s: float | None = None) -> LeaseInfo:
        body = {"ttl_s": ttl_s} if ttl_s is not None else {}
        r = await self.farm._request("POST", self._path("/heartbeat"), json=body, headers=self._headers,
                                     idempotent=True)
        self.info = LeaseInfo.model_validate_json(r.content)
        return self.info

    def start_heartbeat(self, interval: float | None = None) -> None:
        """Keep the lease alive in the background (every ttl/3 by default) until close()."""
        if self._hb_task is None:
            self._hb_task = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(heartbeat_interval(self.info, interval)))

    async def _heartbeat_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.heartbeat()
            except (LeaseGoneError, UnknownDesktopError, ForeignLeaseError):
                return  # nothing left to keep alive
            except FarmAPIError:
                continue  # transient (farm restarting, network blip): try again next tick

    async def guest(self, method: str, path: str, check: bool = True, **kw: Any) -> httpx.Response:
        """Call the guest's OSWorld-compatible route ``path`` (e.g. ``"/execute"``) through the farm.

        ``kw`` goes to httpx (json=, data=, files=, params=, timeout=). With ``check`` an error
        status raises FarmAPIError with the guest's message.
        """
        headers = {**self._headers, **kw.pop("headers", {})}
        kw.setdefault("timeout", 300.0)
        r = await self.farm._request(method, self._path(guest_route(path)), headers=headers, check=check,
                                     **kw)
        return r

    async def close(self) -> None:
        """Release the lease (idempotent; a lease already gone is not an error)."""
        if self._hb_task is not None:
            self._hb_task.cancel()
            try:
                await self._hb_task
            except (asyncio.CancelledError, Exception):
                pass
            self._hb_task = None
        if self._closed:
            return
        self._closed = True
        try:
            await self.farm._request("DELETE", self._path(), headers=self._headers)
        except (LeaseGoneError, UnknownDesktopError):
            pass

    release = close

    async def __aenter__(self) -> AsyncRemoteDesktop:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncFarm:
    """Async client of one farm. ``url``/``token`` default to OSFARM_URL / OSFARM_TOKEN."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None, retry_s: float = RETRY_S,
                 expect_up: bool = False, local_address: str | None = None):
        """``expect_up``: the farm is known to exist (a worker bound to it), so connection errors
        are retried from the first request on; otherwise only once it has answered.
        ``local_address``: connect from this address of the machine (default: the process's
        source address, ``osfarm worker --bind-address``; none: the kernel's choice)."""
        self.url, self.token = resolve_farm(url, token)  # the token also opens the guest passthrough (TaskEnv)
        self._http = httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"},
                                       timeout=timeout, transport=transport or async_transport(local_address))
        self._retries = Retries(retry_s, expect_up)

    async def _request(self, method: str, path: str, check: bool = True, idempotent: bool | None = None,
                       **kw: Any) -> httpx.Response:
        """One call; retried across a farm restart as the module doc says (``idempotent``
        overrides what the method implies, e.g. for heartbeats)."""
        idem, deadline = self._retries.start(method, idempotent)
        while True:
            try:
                r = await self._http.request(method, path, **kw)
            except httpx.TransportError as e:
                delay = self._retries.after_error(e, idem, deadline)
                if delay is None:
                    raise FarmUnreachableError(0, f"cannot reach the farm at {self.url}: {e}") from None
                await asyncio.sleep(delay)
                continue
            delay = self._retries.after_answer(r, idem, deadline)
            if delay is None:
                return check_answer(r) if check else r
            await r.aclose()
            await asyncio.sleep(delay)

    async def lease(self, owner: str | None = None, ttl_s: float | None = None, wait_s: float = 30.0,
                    heartbeat: bool | float = False, task_id: str | None = None) -> AsyncRemoteDesktop:
        """Lease a desktop. ``heartbeat=True`` (or an interval in s) keeps it alive in the background;
        ``task_id`` says what it is for (shown on the farm's dashboard)."""
        r = await self._request("POST", "/v1/desktops", json=lease_body(owner, ttl_s, wait_s, task_id),
                                timeout=wait_s + 120.0)
        desk = AsyncRemoteDesktop(self, LeaseInfo.model_validate_json(r.content))
        if heartbeat is not False:
            desk.start_heartbeat(None if heartbeat is True else float(heartbeat))
        return desk

    async def desktop(self, lease_id: str, owner: str | None = None) -> AsyncRemoteDesktop:
        """Attach to an existing lease by id."""
        headers = {OWNER_HEADER: owner} if owner else {}
        r = await self._request("GET", f"/v1/desktops/{lease_id}", headers=headers)
        return AsyncRemoteDesktop(self, LeaseInfo.model_validate_json(r.content))

    async def release(self, lease_id: str, owner: str | None = None) -> None:
        headers = {OWNER_HEADER: owner} if owner else {}
        await self._request("DELETE", f"/v1/desktops/{lease_id}", headers=headers)

    async def pool(self) -> PoolStatus:
        """The pool's desktops and their states, leases and waiters."""
        return PoolStatus.model_validate_json((await self._request("GET", "/v1/pool")).content)

    async def whoami(self) -> WhoAmI:
        """This token's principal: name, role, limits, leases held."""
        return WhoAmI.model_validate_json((await self._request("GET", "/v1/whoami")).content)

    async def healthz(self) -> Healthz:
        return Healthz.model_validate_json((await self._request("GET", "/healthz")).content)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncFarm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
