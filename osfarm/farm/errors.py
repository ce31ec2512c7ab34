"""Errors of the farm: the pool's (``FarmError`` and kin) and the routes' (``ApiError``); the app
maps each to an HTTP status with the message as ``{"detail": ...}``."""

from __future__ import annotations

from osfarm.errors import OsfarmError


class FarmError(OsfarmError):
    status: int = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class UnknownDesktop(FarmError):
    """No lease with this id was ever handed out (404)."""

    status = 404


class LeaseGone(FarmError):
    """The lease expired, was released, or its desktop crashed (410); lease a new desktop."""

    status = 410


class ForeignLease(FarmError):
    """The lease belongs to another owner (403)."""

    status = 403


class Busy(FarmError):
    """The desktop is in the middle of an operation that excludes this one (409)."""

    status = 409


class ResetFailed(FarmError):
    """The provider could not reset the desktop; the lease has ended (502)."""

    status = 502


class CapacityError(FarmError):
    """No desktop can be handed out: 429 when every desktop is leased (retry later),
    503 when desktops cannot be started (provider failing)."""

    def __init__(self, message: str, status: int = 429, retry_after_s: float = 1.0):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class QuotaExceeded(FarmError):
    """The client holds as many leases as its token allows (429, no Retry-After: waiting does
    not help, releasing one does); ``max_leases`` is its quota."""

    status = 429

    def __init__(self, message: str, max_leases: int):
        super().__init__(message)
        self.max_leases = max_leases


class ApiError(OsfarmError):
    """An HTTP error raised inside a route (not by the pool); answered as ``{"detail": message}``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def describe(exc: BaseException) -> str:
    """``Type: message`` (or just the type when the message is empty), for error details."""
    text = str(exc) or ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
