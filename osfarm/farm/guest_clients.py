"""The pool's HTTP clients to its desktops' guest servers, for health checks.

One client per box, kept while the box lives (building one per check costs an SSL context each
time), dropped when the box goes: closed only once a health check still using it has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from osfarm.http.errors import error_detail
from osfarm.providers.base import DesktopHandle, GuestEndpoint

HEALTH_TIMEOUT_S = 3.0


async def guest_health_problem(endpoint: GuestEndpoint) -> str | None:
    """One health check with a client of its own: None when the guest answers ``/v1/health``
    with 200, else why not (a box taken over after a farm restart)."""
    client = endpoint.client(timeout=HEALTH_TIMEOUT_S)
    try:
        r = await client.get("/v1/health")
    except httpx.HTTPError as e:
        return f"its guest does not answer: {e!r}"
    finally:
        await client.aclose()
    return None if r.status_code == 200 else f"its guest's health answered {r.status_code}"


async def _close_after(client: httpx.AsyncClient, check: asyncio.Task[Any] | None) -> None:
    """Close a box's health-check client once the check still using it has ended.

    Closed under a check waiting for the guest's answer, the unix-socket stream (anyio, under
    httpx) resolves the pending read itself while uvloop still polls the socket; the box's end
    then makes the socket readable and the poll resolves the read again: "Exception in callback
    <built-in method set_result of _asyncio.Future> ... InvalidStateError" on the farm's loop.
    The check ends soon anyway (its box is going, and it has a timeout); its result is stale.
    """
    if check is not None:
        await asyncio.wait({check})
    await client.aclose()


class GuestClients:
    """Health-check clients by desktop id. ``spawn`` runs a coroutine in the background (the
    pool's, so that closing the pool waits for the closes)."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, None]], object]):
        self._spawn = spawn
        self._clients: dict[str, tuple[DesktopHandle, httpx.AsyncClient]] = {}
        self._checks: dict[str, asyncio.Task[Any]] = {}  # checks using a client now, by desktop

    async def health(self, desktop_id: str, handle: DesktopHandle) -> tuple[str | None, bool]:
        """Ask the box's guest ``/v1/health``: (failure reason or None, whether the failure only
        counts as a strike: a timeout or a connection error, not a wrong answer)."""
        client = self._client(desktop_id, handle)
        task = asyncio.current_task()
        if task is not None:  # a drop meanwhile closes the client after this check
            self._checks[desktop_id] = task
        try:
            r = await client.get("/v1/health")
        except httpx.HTTPError as e:
            return f"guest unreachable: {e!r}", True
        finally:
            if task is not None and self._checks.get(desktop_id) is task:
                del self._checks[desktop_id]
        if r.status_code != 200:
            return f"guest health returned {r.status_code}: {error_detail(r.content, limit=300)}", False
        return None, False

    def _client(self, desktop_id: str, handle: DesktopHandle) -> httpx.AsyncClient:
        cached = self._clients.get(desktop_id)
        if cached is not None and cached[0] is handle:
            return cached[1]
        self.drop(desktop_id)
        client = handle.endpoint.client(timeout=HEALTH_TIMEOUT_S)
        self._clients[desktop_id] = (handle, client)
        return client

    def drop(self, desktop_id: str) -> None:
        """The box is going (released, reset, removed): close its client once unused."""
        cached = self._clients.pop(desktop_id, None)
        if cached is not None:
            self._spawn(_close_after(cached[1], self._checks.get(desktop_id)))

    async def aclose(self) -> None:
        """Close every client now (the pool's background work has ended)."""
        for _, client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._clients.clear()
