"""The blocking farm client: ``Farm`` and its leased ``RemoteDesktop`` (one ``httpx.Client``, no
event loop per call)."""

from __future__ import annotations

import threading
import time
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
from osfarm.http.source_address import sync_transport
from osfarm.schema.actions import AgentAction
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionTiming, StepResult
from osfarm.schema.lease import LeaseInfo
from osfarm.schema.observation import Observation, ObserveOptions
from osfarm.schema.pool import PoolStatus
from osfarm.schema.service import Healthz, WhoAmI


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
        body = step_body(actions, observe, code_timeout, timing)
        r = self.farm._request("POST", self._path("/step"), json=body, headers=self._headers,
                               timeout=step_timeout(body))
        return StepResult.model_validate_json(r.content)

    def observe(self, **opts: Any) -> Observation:
        r = self.farm._request("GET", self._path("/observation"), params=observe_params(opts), headers=self._headers)
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
        every = heartbeat_interval(self.info, interval)

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
        self.url, self.token = resolve_farm(url, token)
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"},
                                  timeout=timeout, transport=transport or sync_transport(local_address))
        self._retries = Retries(retry_s, expect_up)

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
                return check_answer(r) if check else r
            r.close()
            time.sleep(delay)

    def lease(self, owner: str | None = None, ttl_s: float | None = None, wait_s: float = 30.0,
              heartbeat: bool | float = False, task_id: str | None = None) -> RemoteDesktop:
        """Lease a desktop. ``heartbeat=True`` (or an interval in s) keeps it alive in the background;
        ``task_id`` says what it is for (shown on the farm's dashboard)."""
        r = self._request("POST", "/v1/desktops", json=lease_body(owner, ttl_s, wait_s, task_id),
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
