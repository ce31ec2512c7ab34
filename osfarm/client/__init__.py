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

from osfarm.client.async_client import AsyncFarm, AsyncRemoteDesktop
from osfarm.client.errors import (
    AuthError,
    DesktopGuestError,
    FarmAPIError,
    FarmCapacityError,
    FarmUnreachableError,
    ForeignLeaseError,
    InvalidRequestError,
    LeaseGoneError,
    LeaseQuotaError,
    RequestTooLargeError,
    UnknownDesktopError,
)
from osfarm.client.sync_client import Farm, RemoteDesktop
from osfarm.client.wire import DEFAULT_URL, OWNER_HEADER, RETRY_S, guest_route, screenshot_bytes, screenshot_image

__all__ = [
    "AsyncFarm", "AsyncRemoteDesktop", "AuthError", "DesktopGuestError", "Farm", "FarmAPIError", "FarmCapacityError",
    "FarmUnreachableError", "ForeignLeaseError", "InvalidRequestError",
    "LeaseGoneError", "LeaseQuotaError", "RemoteDesktop", "RequestTooLargeError", "UnknownDesktopError",
    "screenshot_bytes", "screenshot_image", "guest_route", "DEFAULT_URL", "OWNER_HEADER", "RETRY_S",
]  # fmt: skip
