"""The test farm: one in-process farm of real sandbox desktops (uvicorn on 127.0.0.1), started
once per test session by the ``farm`` fixture of conftest.py and shared by every module that
asks for it; ``running_farm`` starts others (another provider, other settings)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from osfarm.config import FarmSettings
from osfarm.farm.api import UiMount
from osfarm.farm.local import local_farm
from osfarm.farm.server import FarmServer

W, H = 1024, 768
TOKEN = "test-farm-token-1234"


def farm_settings(state_dir: str, **overrides: Any) -> FarmSettings:
    """The shared farm's settings (``overrides`` win): 1024x768 sandbox desktops, two kept warm,
    three at most (the tests lease up to three at once). private_network gives each box its own
    network namespace, so its X server's abstract socket (@/tmp/.X11-unix/X0) cannot collide
    with other X servers on this host."""
    values: dict[str, Any] = dict(pool_min=2, pool_max=3, width=W, height=H, state_dir=state_dir, token=TOKEN,
                                  private_network=True, lease_ttl_s=120, health_interval_s=1.0, port=0)
    return FarmSettings(**{**values, **overrides})


@contextlib.contextmanager
def running_farm(prefix: str = "osf", start_timeout_s: float = 180.0, ui: UiMount | None = None,
                 **overrides: Any) -> Iterator[FarmServer]:
    """A farm on a temporary state dir, stopped with its desktops (and the dir removed) on exit.

    The dir is short (guest sockets live under it and sun_path is 108 bytes): under
    OSFARM_STATE_DIR when set, else /tmp.
    """
    base = os.environ.get("OSFARM_STATE_DIR") or "/tmp"
    Path(base).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=base) as d:
        settings = farm_settings(d, **overrides)
        with local_farm(settings, extra_wait_s=max(0.0, start_timeout_s - settings.start_timeout_s), ui=ui) as server:
            yield server


def release_all_leases(server: FarmServer) -> int:
    """End every lease still held (by a test that failed or killed its client); returns how many."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=60) as c:
        held = [d["lease_id"] for d in c.get("/v1/pool").raise_for_status().json()["desktops"] if d.get("lease_id")]
        for lease_id in held:
            c.delete(f"/v1/desktops/{lease_id}")
    return len(held)
