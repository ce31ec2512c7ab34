"""``/v1/desktops/{lease_id}/guest/{path}``: any request passed through to the guest's
OSWorld-compatible route ``/{path}``, streamed both ways (uploads and recordings can be large,
and a chunked copy keeps the farm's memory flat). OSWorld's own ``PythonController`` can use it
as its VM address."""

from __future__ import annotations

import posixpath
import re
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from osfarm.farm.error_responses import DESKTOP_ERRORS
from osfarm.farm.errors import ApiError, describe
from osfarm.farm.state import LeaseOf, State

# Guest calls that may legitimately block for long (OSWorld's /setup/open_file waits up to 30
# min for a window; /execute runs commands for up to 120 s): no read timeout beyond this.
PASSTHROUGH_TIMEOUT = httpx.Timeout(connect=10.0, read=1900.0, write=120.0, pool=60.0)
# Errors that mean "the guest did not answer at all" (socket gone, process died mid-reply).
_UNREACHABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Hop-by-hop or recomputed headers that must not be copied between the two connections.
_REQUEST_HEADERS = ("content-type", "content-length", "accept", "content-encoding")
_RESPONSE_HEADERS = ("content-type", "content-length", "content-encoding", "content-disposition", "cache-control",
                     "allow")

router = APIRouter(tags=["guest passthrough"])

# The passthrough's paths (uploads to the guest go here: their own body limit, max_upload_bytes).
PATH_REGEX = r"/v1/desktops/[^/]+/guest(/|$)"


# The guest's routes that are the farm's own: a warm reset re-arms the guest with a token the farm
# chooses, and the baseline is what warm resets go back to. A lease holder reaching them could set
# the guest's token (and cut the farm off its desktop) or make the agent's state the baseline.
FARM_ONLY = frozenset({"/v1/session/warm_reset", "/v1/session/baseline"})


def farm_only(path: str) -> bool:
    """True when ``path`` names one of the FARM_ONLY routes, however it is spelled (extra or
    trailing slashes, dot segments: the guest's URL is normalised on the way)."""
    return posixpath.normpath(re.sub(r"/+", "/", "/" + path)).rstrip("/") in FARM_ONLY


async def guest_passthrough(path: str, request: Request, lease: LeaseOf, state: State) -> Response:
    if farm_only(path):
        raise ApiError(403, f"/{path.lstrip('/')} is the farm's own route of the guest (warm reset), "
                            "not open to clients")
    headers = {k: request.headers[k] for k in _REQUEST_HEADERS if k in request.headers}
    has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
    url = "/" + quote(path, safe="/:@!$&'()*+,;=-._~")
    if request.url.query:
        url += "?" + request.url.query
    client = state.guest(lease).client
    req = client.build_request(
        request.method, url, headers=headers, content=request.stream() if has_body else None,
        timeout=PASSTHROUGH_TIMEOUT,
    )  # fmt: skip
    try:
        r = await client.send(req, stream=True)
    except _UNREACHABLE as e:
        raise await state.unreachable(lease, e) from None
    except httpx.TimeoutException as e:
        raise ApiError(504, f"the desktop's guest server did not answer in time ({describe(e)})") from None
    out = {k: r.headers[k] for k in _RESPONSE_HEADERS if k in r.headers}
    return StreamingResponse(r.aiter_raw(), status_code=r.status_code, headers=out, background=BackgroundTask(r.aclose))


# The guest's answer passes through as it is: any status, any body. The OpenAPI document says so
# (a "default" response) next to the farm's own errors, for every method the route serves.
_RESPONSES = {**DESKTOP_ERRORS, "default": {"description": "the guest's own answer (status, headers and body as "
                                                           "its OSWorld-compatible route gave them)"}}

# One route per method so each gets its own OpenAPI operation id.
for _method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
    router.add_api_route(
        "/v1/desktops/{lease_id}/guest/{path:path}", guest_passthrough, methods=[_method],
        operation_id=f"guest_passthrough_{_method.lower()}",
        summary=f"{_method} to the guest's OSWorld-compatible route `/{{path}}`",
        response_class=Response, responses=_RESPONSES,
    )  # fmt: skip
