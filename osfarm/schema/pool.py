"""Wire model of the farm's pool status (``GET /v1/pool``): its desktops and their states."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DesktopStatus(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    state: str = Field(description="starting, ready, leased, resetting, failed or stopping")
    lease_id: str | None = None
    since: float = Field(description="unix time the desktop entered this state")


class PoolStatus(BaseModel):
    """What the pool reports (keys the pool adds later pass through unchanged)."""

    model_config = ConfigDict(extra="allow")

    desktops: list[DesktopStatus] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict, description="desktops per state")
    pool_min: int | None = None
    pool_max: int | None = None
    leases: int | None = Field(default=None, description="live leases")
    waiting: int | None = Field(default=None, description="lease requests waiting for a desktop")
    start_failures: int | None = Field(default=None, description="desktop start/reset failures in a row")
    last_error: str | None = None
