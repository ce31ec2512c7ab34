"""Wire models of a lease on a farm desktop: asking for one, keeping it alive, and what the farm
says about it (``POST /v1/desktops``, ``GET``/heartbeat ``/v1/desktops/{id}``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from osfarm.schema.observation import ScreenSize


class _Strict(BaseModel):
    # Unknown keys are rejected so a typo ("ttl": 5) gets a 422 instead of being ignored, and values
    # must have the type the schema says ("5" is not a number): what OpenAPI documents is what passes.
    model_config = ConfigDict(extra="forbid", strict=True)


# A lease shorter than a second cannot be used (a client's first call would find it expired);
# 5e-324 passed ``gt=0`` and made a lease that was born expired.
MIN_TTL_S = 1.0


class LeaseRequest(_Strict):
    owner: str | None = Field(
        default=None,
        max_length=200,
        description="who holds the lease; later calls may send it as X-Osfarm-Owner to guard "
        "against using someone else's desktop",
    )
    ttl_s: float | None = Field(
        default=None, ge=MIN_TTL_S, le=86400, description="lease expires this long after its last heartbeat"
    )
    wait_s: float = Field(
        default=30.0, ge=0, le=600, description="how long to wait for a free desktop before answering 429"
    )
    task_id: str | None = Field(default=None, max_length=200, description="the task the lease is for "
                                "(shown on the dashboard's pool page; a reset to a task sets it too)")


class HeartbeatRequest(_Strict):
    ttl_s: float | None = Field(
        default=None, ge=MIN_TTL_S, le=86400, description="new TTL from now; default: the lease's"
    )


class ControlInfo(BaseModel):
    by: str = Field(description="who took control (the dashboard user's name)")
    started_at: float = Field(description="unix time control was taken")
    ended_at: float | None = Field(default=None, description="unix time it was handed back; null: still in control")


class LeaseInfo(BaseModel):
    id: str = Field(description="lease id; use it in every /v1/desktops/{id}/... call")
    desktop_id: str
    owner: str | None = None
    created_at: float = Field(description="unix time the lease was granted")
    expires_at: float = Field(description="unix time the lease expires without a heartbeat")
    ttl_s: float
    wait_s: float = Field(default=0.0, description="how long the lease request waited for a desktop")
    screen: ScreenSize
    guest_url: str = Field(description="path of the OSWorld-compatible guest passthrough")
    provider: str = Field(default="sandbox", description="the box: sandbox, docker or libvirt")
    image: str | None = Field(default=None, description="the desktop image (docker, libvirt); none for sandbox")
    desktop: str | None = Field(default=None, description="the desktop session: gnome (OSWorld's Ubuntu GNOME) or "
                                "light (openbox); null for a lease taken over after a farm restart")
    client: str | None = Field(default=None, description="name of the token (client) holding the lease")
    control: list[ControlInfo] = Field(
        default_factory=list,
        description="people who took control of this desktop from the dashboard (/ui), oldest first: the "
        "episode ran with human help while any span overlaps it",
    )
    cpu_s: float | None = Field(
        default=None,
        description="CPU-seconds the desktop used since the lease was granted (its processes, resets in place "
        "excluded), as of this answer; null where the provider cannot tell",
    )
    reset_mode: str | None = Field(
        default=None, description="how the desktop was made ready for this lease (or its last reset in place): "
        "warm (the session put back, proven by its fingerprint), cold (a new box for the desktop) or start (a "
        "desktop's first box); null for a lease taken over after a farm restart",
    )
    reset_fallback: str | None = Field(
        default=None, description="a cold reset where a warm one was meant: why (mismatch, error, timeout, every_n, "
        "dead)",
    )
