"""The farm client's errors: one class per kind of answer, with the server's status and message."""

from __future__ import annotations

import httpx

from osfarm.errors import OsfarmError
from osfarm.http.errors import error_detail


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


def error_for(r: httpx.Response) -> FarmAPIError:
    detail = error_detail(r.content, fallback=r.reason_phrase)
    retry = r.headers.get("retry-after")
    retry_s = float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
    cls = _BY_STATUS.get(r.status_code) or (DesktopGuestError if r.status_code >= 500 else FarmAPIError)
    if r.status_code == 429 and "x-osfarm-quota" in r.headers:
        cls = LeaseQuotaError
    return cls(r.status_code, detail, retry_s)


def check_answer(r: httpx.Response) -> httpx.Response:
    if r.status_code >= 400:
        raise error_for(r)
    return r
