"""A lease: one client's hold on one desktop of the pool, as the pool hands it out and keeps it.

The pool (farm/pool.py) makes, renews and ends leases; the API, the farm state and the
dashboard read them.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

from osfarm.providers.base import GuestEndpoint


@dataclass
class ControlSpan:
    """Someone drove a leased desktop by hand (the dashboard's take-over): the lease holder sees
    it in the lease info and the runner records it in the episode (``controlled_by``)."""

    by: str
    started_at: float
    ended_at: float | None = None


@dataclass
class Lease:
    id: str
    desktop_id: str
    owner: str | None
    created_at: float
    expires_at: float
    ttl_s: float
    endpoint: GuestEndpoint
    screen: tuple[int, int]
    wait_s: float
    provider: str = "sandbox"
    image: str | None = None
    desktop: str | None = None  # the session (gnome, light); None for a lease taken over after a restart
    principal: str | None = None  # the client (token) holding it; only it and admins see the lease
    task_id: str | None = None  # the task of the last reset to a task (shown on the dashboard)
    control: list[ControlSpan] = field(default_factory=list)  # people who took control (dashboard)
    # CPU-seconds the desktop used for this lease (its boxes' processes, resets in place
    # excluded): ``cpu_acc`` of earlier boxes plus the current box's since ``cpu_mark``.
    cpu_mark: float | None = None
    cpu_acc: float = 0.0
    cpu_s: float | None = None  # the latest reading (heartbeat, release): the runner records it
    # how its desktop was made ready (the runner records it): "warm", "cold" (a box restarted,
    # ``reset_fallback`` naming why where a warm reset was meant) or "start" (a new box)
    reset_mode: str | None = None
    reset_fallback: str | None = None


_LEASE_ID_ALPHABET = string.ascii_letters + string.digits


def new_lease_id() -> str:
    """A fresh, unguessable lease id: 24 letters and digits (142 random bits).

    Not base64url: its '-' and '_' made one id in 64 begin with '-', which a command line reads
    as an option (``osfarm desktop release -Ao3...``); letters and digits are one word in a
    URL, a shell and a terminal's double-click alike."""
    return "".join(secrets.choice(_LEASE_ID_ALPHABET) for _ in range(24))
