"""Suite-wide fixtures and checks: the shared farm, a shared Redis, and no process of ours left
behind. The helpers themselves live in the ``osfarm.testing`` package (shared with bench/)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from osfarm.farm.server import FarmServer
from osfarm.providers.sandbox import SANDBOX_ENV
from osfarm.testing.farms import release_all_leases, running_farm
from osfarm.testing.redis_server import RedisServer

# unit / desktop / acceptance: every test's tier, and the guard on the unit tier (tests/tiers.py)
pytest_plugins = ["tiers"]

# The suite's desktops are the light ones (openbox), the cheapest: GNOME, the default desktop,
# costs ~2.5x the CPU and memory per desktop and ~15x per warm reset (bench/reset_latency.py),
# which the 45 minutes of the whole suite cannot pay on every test. The tests that are about
# the GNOME desktop, or must hold on it (the default), say desktop="gnome" or OSFARM_DESKTOP=gnome.
os.environ.setdefault("OSFARM_DESKTOP", "light")

# -- the shared farm ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def session_farm() -> Iterator[FarmServer]:
    """One farm for the whole session: its desktops are started once and reset between leases."""
    with running_farm() as server:
        yield server


@pytest.fixture(scope="module")
def farm(session_farm: FarmServer) -> Iterator[FarmServer]:
    """The session's farm (settings: osfarm.testing.farms.farm_settings). Leases a module leaves behind are released
    when it ends, so every module starts with all desktops free."""
    yield session_farm
    release_all_leases(session_farm)


@pytest.fixture(scope="module")
def api(farm: FarmServer) -> Iterator[httpx.Client]:
    """A client of the farm's REST API with its token."""
    with httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {farm.token}"}, timeout=180) as c:
        yield c


@pytest.fixture(scope="session")
def redis_session() -> Iterator[RedisServer]:
    """One redis-server for the whole session, for the tests that need one (skipped without it)."""
    with RedisServer() as server:
        yield server


# -- no process left behind -----------------------------------------------------------------------


def _lock_holder(sandbox_dir: str) -> int | None:
    """The pid of the farm whose sandbox holds this box (``<state_dir>/sandbox/<id>``): it
    wrote its pid into ``<state_dir>/sandbox.lock``."""
    try:
        return int((Path(sandbox_dir).parent.parent / "sandbox.lock").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _is_ours(p: psutil.Process, mine: set[int]) -> bool:
    """A sandbox box's process (it carries OSFARM_SANDBOX_DIR), unless a live farm that is not
    this test process or one of its children holds that sandbox: other test runs on this
    machine are not ours to judge."""
    try:
        env = p.environ()
    except psutil.Error:
        return False
    box = env.get(SANDBOX_ENV)
    if box is None:
        return False
    holder = _lock_holder(box)
    return holder is None or holder in mine or not psutil.pid_exists(holder)


def _leftovers() -> list[str]:
    me = psutil.Process()
    found: dict[int, str] = {}
    children = me.children(recursive=True)
    for p in children:
        found[p.pid] = " ".join(p.cmdline()[:4]) if p.is_running() else ""
    mine = {me.pid, *(c.pid for c in children)}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if p.pid == me.pid:
            continue
        try:
            if _is_ours(p, mine):
                found[p.pid] = " ".join((p.info["cmdline"] or [])[:4])
        except psutil.Error:
            pass
    alive = []
    for pid, cmd in found.items():
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {cmd}")
        except psutil.Error:
            pass
    return alive


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("OSFARM_SKIP_LEAK_CHECK"):
        return
    deadline = time.monotonic() + 10
    left = _leftovers()
    while left and time.monotonic() < deadline:  # processes being torn down get a moment to exit
        time.sleep(0.2)
        left = _leftovers()
    if left:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = "processes left behind by the test run:\n  " + "\n  ".join(left)
        if tr:
            tr.write_line("LEAK CHECK FAILED: " + msg, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
