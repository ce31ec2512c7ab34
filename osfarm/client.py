"""Python client of the farm API: ``AsyncFarm`` (asyncio) and ``Farm`` (blocking).

A leased desktop is a small gymnasium-like environment::

    with Farm("http://127.0.0.1:8765", token) as farm, farm.lease(ttl_s=120) as desk:
        result = desk.step({"action_type": "CLICK", "parameters": {"x": 10, "y": 20}},
                           observe={"format": "jpeg", "scale": 0.5})
        image = screenshot_image(result.observation)

Every farm error raises a :class:`FarmAPIError` subclass carrying the server's status and
message (``LeaseGoneError`` for 410, ``FarmCapacityError`` for 429/503, ...). The sync client
wraps one ``httpx.Client`` (no event loop per call); both keep connections alive.

Across a farm restart (or a dropped connection) a client that has reached its farm before
retries for up to ``retry_s`` (default 60 s), with exponential backoff and jitter: any request
the farm never received (connection refused or not made), and idempotent requests (GET, HEAD,
DELETE, heartbeats) whose answer was lost or was 502/503. A step or a lease whose request may
have reached the farm is never sent twice. A farm never reached fails at once (a wrong URL), unless
the client is told it exists (``expect_up``: a worker bound to its farm).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

import httpx
from PIL import Image
from pydantic import BaseModel

from osfarm.errors import OsfarmError
from osfarm.http.errors import error_detail
from osfarm.http.retry import Deadline
from osfarm.http.source_address import async_transport, sync_transport
from osfarm.schema.actions import AgentAction, action_json
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionTiming, StepResult
from osfarm.schema.lease import LeaseInfo
from osfarm.schema.observation import Observation, ObserveOptions
from osfarm.schema.pool import PoolStatus
from osfarm.schema.service import Healthz, WhoAmI

DEFAULT_URL = "http://127.0.0.1:8765"
OWNER_HEADER = "X-Osfarm-Owner"
RETRY_S = 60.0  # how long a request is retried across a farm restart
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "PUT"})
# The request never left this machine: safe to send again whatever it does.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# The answer was lost on the way back: safe to send again only when repeating changes nothing.
_LOST = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.PoolTimeout)
_RETRY_STATUSES = (502, 503)  # the farm restarting, or a dropped link to the guest: try again


def guest_route(path: str) -> str:
    """The lease-relative route of the guest's ``path``: ``/guest/<path>``.

    A ``.`` or ``..`` segment is refused (ValueError naming ``path``): httpx resolves dot segments
    before sending, so ``../../..`` would climb out of the lease's guest routes onto the farm's
    own API, with this client's token (the OSWorld drop-in forwards paths that agents choose).
    """
    route = path.split("?", 1)[0]
    if any(seg in (".", "..") for seg in unquote(route).split("/")):
        raise ValueError(f"path: {path!r} has a '.' or '..' segment; guest routes are plain paths")
    return "/guest/" + path.lstrip("/")


# ---- errors -----------------------------------------------------------------------------------


class FarmAPIError(OsfarmError):
    """The farm answered an error. ``status`` is the HTTP status, ``detail`` its message."""

    def __init__(self, status: int, detail: str, retry_after_s: float | None = None):
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail
        self.retry_after_s = retry_after_s


class InvalidRequestError(FarmAPIError):
    """400/422: the request was malformed; the detail names the field."""


class AuthError(FarmAPIError):
    """401: missing or wrong token."""


class ForeignLeaseError(FarmAPIError):
    """403: the lease belongs to another owner."""


class UnknownDesktopError(FarmAPIError):
    """404: no such lease (or, through the guest passthrough, no such guest route/file)."""


class LeaseGoneError(FarmAPIError):
    """410: the lease expired or was released, or its desktop crashed: lease a new desktop."""


class FarmCapacityError(FarmAPIError):
    """429 (every desktop leased; retry after ``retry_after_s``) or 503 (cannot start desktops)."""


class LeaseQuotaError(FarmCapacityError):
    """429 with ``X-Osfarm-Quota``: this token holds as many leases as it may; release one (waiting
    does not help)."""


class RequestTooLargeError(InvalidRequestError):
    """413: the request body is over the farm's limit (the detail names it)."""


class DesktopGuestError(FarmAPIError):
    """5xx: the desktop's guest server failed or timed out (the lease may still be usable)."""


class FarmUnreachableError(FarmAPIError):
    """The farm itself could not be reached (status 0)."""


_BY_STATUS: dict[int, type[FarmAPIError]] = {
    400: InvalidRequestError, 422: InvalidRequestError, 401: AuthError, 403: ForeignLeaseError,
    404: UnknownDesktopError, 410: LeaseGoneError, 413: RequestTooLargeError, 429: FarmCapacityError,
    503: FarmCapacityError,
}  # fmt: skip


def _error_for(r: httpx.Response) -> FarmAPIError:
    detail = error_detail(r.content, fallback=r.reason_phrase)
    retry = r.headers.get("retry-after")
    retry_s = float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
    cls = _BY_STATUS.get(r.status_code) or (DesktopGuestError if r.status_code >= 500 else FarmAPIError)
    if r.status_code == 429 and "x-osfarm-quota" in r.headers:
        cls = LeaseQuotaError
    return cls(r.status_code, detail, retry_s)


def _check(r: httpx.Response) -> httpx.Response:
    if r.status_code >= 400:
        raise _error_for(r)
    return r


class _Retries:
    """When a request to a farm may be sent again, and how long to wait first (module doc)."""

    def __init__(self, retry_s: float, expect_up: bool = False):
        self.retry_s = retry_s
        # the farm answered once (or is known to exist): a connection error is a restart, not a typo
        self.reached = expect_up

    def start(self, method: str, idempotent: bool | None) -> tuple[bool, Deadline | None]:
        idem = method.upper() in IDEMPOTENT_METHODS if idempotent is None else idempotent
        return idem, (Deadline(self.retry_s, base_s=0.25, cap_s=5.0) if self.retry_s > 0 else None)

    def after_error(self, e: httpx.TransportError, idem: bool, deadline: Deadline | None) -> float | None:
        if deadline is None or not self.reached:
            return None
        if isinstance(e, _NOT_SENT) or (idem and isinstance(e, _LOST)):
            return deadline.next_delay()
        return None

    def after_answer(self, r: httpx.Response, idem: bool, deadline: Deadline | None) -> float | None:
        self.reached = True
        if deadline is None or not idem or r.status_code not in _RETRY_STATUSES:
            return None
        return deadline.next_delay()


# ---- helpers shared by both clients ---------------------------------------------------------


def screenshot_bytes(obs: Observation) -> bytes:
    """The observation's screenshot as encoded image bytes (PNG/JPEG/WebP)."""
    if obs.screenshot is None:
        raise ValueError("this observation has no screenshot (observe with screenshot=True)")
    return base64.b64decode(obs.screenshot)


def screenshot_image(obs: Observation) -> Image.Image:
    """The observation's screenshot decoded as a PIL image."""
    img = Image.open(io.BytesIO(screenshot_bytes(obs)))
    img.load()
    return img


def _step_body(actions: AgentAction | Sequence[AgentAction], observe: ObserveOptions | dict[str, Any] | bool | None,
               code_timeout: float, timing: ActionTiming = DEFAULT_ACTION_TIMING) -> dict[str, Any]:
    # One action (dict, model or code string) or a list of them.
    items = [actions] if isinstance(actions, (str, dict, BaseModel)) else actions
    body: dict[str, Any] = {"actions": [action_json(a) for a in items], "code_timeout": code_timeout,
                            "timing": timing}
    if observe is True:
        observe = ObserveOptions()
    if isinstance(observe, ObserveOptions):
        body["observe"] = observe.model_dump(mode="json")
    elif isinstance(observe, dict):
        body["observe"] = ObserveOptions(**observe).model_dump(mode="json")
    return body


def _observe_params(opts: dict[str, Any]) -> dict[str, str]:
    o = ObserveOptions(**opts).model_dump()
    return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in o.items()}


def _lease_body(owner: str | None, ttl_s: float | None, wait_s: float, task_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"wait_s": wait_s}
    if owner is not None:
        body["owner"] = owner
    if task_id is not None:
        body["task_id"] = task_id
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    return body


def _resolve(url: str | None, token: str | None) -> tuple[str, str]:
    url = (url or os.environ.get("OSFARM_URL") or DEFAULT_URL).rstrip("/")
    token = token if token is not None else os.environ.get("OSFARM_TOKEN", "")
    if not token:
        raise ValueError("no farm token: pass token= or set OSFARM_TOKEN (`osfarm serve` prints it)")
    return url, token


def _step_timeout(body: dict[str, Any]) -> float:
    return float(body["code_timeout"]) * len(body["actions"]) + 90.0


def _heartbeat_interval(info: LeaseInfo, interval: float | None) -> float:
    return interval if interval is not None else max(0.5, info.ttl_s / 3.0)


# ---- async ----------------------------------------------------------------------------------


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
        body = _step_body(actions, observe, code_timeout, timing)
        r = await self.farm._request("POST", self._path("/step"), json=body, headers=self._headers,
                                     timeout=_step_timeout(body))
        return StepResult.model_validate_json(r.content)

    async def observe(self, **opts: Any) -> Observation:
        """Screenshot/windows/cursor/a11y now; options as in ObserveOptions."""
        r = await self.farm._request("GET", self._path("/observation"), params=_observe_params(opts),
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
                self._heartbeat_loop(_heartbeat_interval(self.info, interval)))

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
        self.url, self.token = _resolve(url, token)  # the token also opens the guest passthrough (TaskEnv)
        self._http = httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"},
                                       timeout=timeout, transport=transport or async_transport(local_address))
        self._retries = _Retries(retry_s, expect_up)

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
                return _check(r) if check else r
            await r.aclose()
            await asyncio.sleep(delay)

    async def lease(self, owner: str | None = None, ttl_s: float | None = None, wait_s: float = 30.0,
                    heartbeat: bool | float = False, task_id: str | None = None) -> AsyncRemoteDesktop:
        """Lease a desktop. ``heartbeat=True`` (or an interval in s) keeps it alive in the background;
        ``task_id`` says what it is for (shown on the farm's dashboard)."""
        r = await self._request("POST", "/v1/desktops", json=_lease_body(owner, ttl_s, wait_s, task_id),
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


# ---- sync -----------------------------------------------------------------------------------


class RemoteDesktop:
    """One leased desktop (blocking). ``close()`` releases it; also a context manager.

    The optional background heartbeat runs in a daemon thread sharing the farm's httpx.Client,
    which is safe to use from several threads.
    """

    def __init__(self, farm: Farm, info: LeaseInfo):
        self.farm = farm
        self.info = info
        self._headers = {OWNER_HEADER: info.owner} if info.owner else {}
        self._hb_stop: threading.Event | None = None
        self._hb_thread: threading.Thread | None = None
        self._closed = False

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def screen(self) -> tuple[int, int]:
        return self.info.screen.width, self.info.screen.height

    def _path(self, suffix: str = "") -> str:
        return f"/v1/desktops/{self.info.id}{suffix}"

    def step(self, actions: AgentAction | Sequence[AgentAction],
             observe: ObserveOptions | dict[str, Any] | bool | None = None,
             code_timeout: float = 30.0, timing: ActionTiming = DEFAULT_ACTION_TIMING) -> StepResult:
        """Run one action or a list of them (computer_13 dicts/models or pyautogui code) with
        OSWorld's semantics, each pause cut short once the screen answered (``timing="settle"``,
        the default: an observation taken at once shows the app's first answer, ``settle_s`` waits
        for the rest), paced exactly as OSWorld paces them (``"osworld"``), or as fast as the
        desktop takes them (``"fast"``)."""
        body = _step_body(actions, observe, code_timeout, timing)
        r = self.farm._request("POST", self._path("/step"), json=body, headers=self._headers,
                               timeout=_step_timeout(body))
        return StepResult.model_validate_json(r.content)

    def observe(self, **opts: Any) -> Observation:
        r = self.farm._request("GET", self._path("/observation"), params=_observe_params(opts), headers=self._headers)
        return Observation.model_validate_json(r.content)

    def screenshot(self, fmt: str = "png", scale: float = 1.0, quality: int = 80) -> bytes:
        r = self.farm._request("GET", self._path("/screenshot"), headers=self._headers,
                               params={"format": fmt, "scale": scale, "quality": quality})
        return r.content

    def heartbeat(self, ttl_s: float | None = None) -> LeaseInfo:
        body = {"ttl_s": ttl_s} if ttl_s is not None else {}
        r = self.farm._request("POST", self._path("/heartbeat"), json=body, headers=self._headers, idempotent=True)
        self.info = LeaseInfo.model_validate_json(r.content)
        return self.info

    def start_heartbeat(self, interval: float | None = None) -> None:
        """Keep the lease alive from a background thread (every ttl/3 by default) until close()."""
        if self._hb_thread is not None:
            return
        stop = threading.Event()
        every = _heartbeat_interval(self.info, interval)

        def loop() -> None:
            while not stop.wait(every):
                try:
                    self.heartbeat()
                except (LeaseGoneError, UnknownDesktopError, ForeignLeaseError):
                    return
                except FarmAPIError:
                    continue
                except RuntimeError:  # client closed underneath us
                    return

        self._hb_stop = stop
        self._hb_thread = threading.Thread(target=loop, name=f"osfarm-heartbeat-{self.id}", daemon=True)
        self._hb_thread.start()

    def guest(self, method: str, path: str, check: bool = True, **kw: Any) -> httpx.Response:
        """Call the guest's OSWorld-compatible route ``path`` (e.g. ``"/execute"``) through the farm."""
        headers = {**self._headers, **kw.pop("headers", {})}
        kw.setdefault("timeout", 300.0)
        return self.farm._request(method, self._path(guest_route(path)), headers=headers, check=check, **kw)

    def close(self) -> None:
        """Release the lease (idempotent; a lease already gone is not an error)."""
        if self._hb_stop is not None and self._hb_thread is not None:
            self._hb_stop.set()
            self._hb_thread.join(timeout=10)
            self._hb_thread = self._hb_stop = None
        if self._closed:
            return
        self._closed = True
        try:
            self.farm._request("DELETE", self._path(), headers=self._headers)
        except (LeaseGoneError, UnknownDesktopError):
            pass

    release = close

    def __enter__(self) -> RemoteDesktop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Farm:
    """Blocking client of one farm. ``url``/``token`` default to OSFARM_URL / OSFARM_TOKEN."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None, retry_s: float = RETRY_S, expect_up: bool = False,
                 local_address: str | None = None):
        """As :class:`AsyncFarm`."""
        self.url, self.token = _resolve(url, token)
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"},
                                  timeout=timeout, transport=transport or sync_transport(local_address))
        self._retries = _Retries(retry_s, expect_up)

    def _request(self, method: str, path: str, check: bool = True, idempotent: bool | None = None,
                 **kw: Any) -> httpx.Response:
        """One call; retried across a farm restart as the module doc says."""
        idem, deadline = self._retries.start(method, idempotent)
        while True:
            try:
                r = self._http.request(method, path, **kw)
            except httpx.TransportError as e:
                delay = self._retries.after_error(e, idem, deadline)
                if delay is None:
                    raise FarmUnreachableError(0, f"cannot reach the farm at {self.url}: {e}") from None
                time.sleep(delay)
                continue
            delay = self._retries.after_answer(r, idem, deadline)
            if delay is None:
                return _check(r) if check else r
            r.close()
            time.sleep(delay)

    def lease(self, owner: str | None = None, ttl_s: float | None = None, wait_s: float = 30.0,
              heartbeat: bool | float = False, task_id: str | None = None) -> RemoteDesktop:
        """Lease a desktop. ``heartbeat=True`` (or an interval in s) keeps it alive in the background;
        ``task_id`` says what it is for (shown on the farm's dashboard)."""
        r = self._request("POST", "/v1/desktops", json=_lease_body(owner, ttl_s, wait_s, task_id),
                          timeout=wait_s + 120.0)
        desk = RemoteDesktop(self, LeaseInfo.model_validate_json(r.content))
        if heartbeat is not False:
            desk.start_heartbeat(None if heartbeat is True else float(heartbeat))
        return desk

    def desktop(self, lease_id: str, owner: str | None = None) -> RemoteDesktop:
        """Attach to an existing lease by id."""
        headers = {OWNER_HEADER: owner} if owner else {}
        r = self._request("GET", f"/v1/desktops/{lease_id}", headers=headers)
        return RemoteDesktop(self, LeaseInfo.model_validate_json(r.content))

    def release(self, lease_id: str, owner: str | None = None) -> None:
        headers = {OWNER_HEADER: owner} if owner else {}
        self._request("DELETE", f"/v1/desktops/{lease_id}", headers=headers)

    def pool(self) -> PoolStatus:
        """The pool's desktops and their states, leases and waiters."""
        return PoolStatus.model_validate_json(self._request("GET", "/v1/pool").content)

    def whoami(self) -> WhoAmI:
        """This token's principal: name, role, limits, leases held."""
        return WhoAmI.model_validate_json(self._request("GET", "/v1/whoami").content)

    def healthz(self) -> Healthz:
        return Healthz.model_validate_json(self._request("GET", "/healthz").content)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Farm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "AsyncFarm", "AsyncRemoteDesktop", "AuthError", "DesktopGuestError", "Farm", "FarmAPIError", "FarmCapacityError",
    "FarmUnreachableError", "ForeignLeaseError", "InvalidRequestError",
    "LeaseGoneError", "LeaseQuotaError", "RemoteDesktop", "RequestTooLargeError", "UnknownDesktopError",
    "screenshot_bytes", "screenshot_image",
]  # fmt: skip
