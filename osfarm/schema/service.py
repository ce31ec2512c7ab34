"""Wire models of the farm's service routes: who the caller is (``GET /v1/whoami``), whether the
farm is up (``GET /healthz``), and the body of every error answer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class WhoAmI(BaseModel):
    """The caller, as its token names it (``GET /v1/whoami``)."""

    name: str
    role: Literal["admin", "client", "viewer"] = Field(description="admin: every lease and the whole pool; client: "
                                                       "its own leases; viewer: read-only pool status")
    max_leases: int | None = Field(default=None, description="most leases held at once; null: no quota")
    max_ttl_s: float | None = Field(default=None, description="longest lease TTL it may ask for; null: no limit")
    leases: int = Field(description="leases it holds now")


class Healthz(BaseModel):
    status: Literal["ok"] = "ok"
    version: str
    provider: str
    uptime_s: float
    ready: bool = Field(description="the pool has started")


class ErrorBody(BaseModel):
    detail: str = Field(description="what went wrong, naming the offending field where there is one")
