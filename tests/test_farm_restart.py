"""The farm survives its own restart: the lease table and desktop registry on disk
(farm/registry.py), desktops taken over by the next farm where their boxes outlive it (docker,
libvirt; the in-memory provider here), leases of boxes that died with the farm (sandbox) ending
with a 410 that says so, and clients retrying across the restart.

First the pool against the in-memory provider (a "crash" abandons a pool without closing it;
the next pool starts on the same registry and provider), then real farms killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from osfarm.client import AsyncFarm, Farm, FarmUnreachableError, LeaseGoneError
from osfarm.config import FarmSettings
from osfarm.farm.errors import LeaseGone, UnknownDesktop
from osfarm.farm.pool import LeasePool
from osfarm.farm.registry import FILE_NAME, FarmRegistry, RegistryError
from osfarm.testing.farm_process import FarmProcess
from osfarm.testing.memory_provider import MemoryProvider

# -- the pool over the in-memory provider -------------------------------------------------------


def _settings(state_dir: Path, **kw: Any) -> FarmSettings:
    opts: dict[str, Any] = dict(state_dir=state_dir, pool_min=1, pool_max=3, lease_ttl_s=30, idle_stop_s=600,
                                health_interval_s=3600)
    return FarmSettings(**{**opts, **kw})


async def _crash(pool: LeasePool) -> None:
    """What SIGKILL leaves: no lease ended, no box stopped; the process's lock on the registry
    goes with it (writes already handed to SQLite are on disk)."""
    assert pool._health_task is not None
    pool._health_task.cancel()
    for t in list(pool._tasks):
        t.cancel()
    assert pool.registry is not None
    await pool.registry.close()


async def test_a_restarted_pool_takes_over_live_leases_and_ready_desktops(tmp_path: Path) -> None:
    boxes = MemoryProvider()
    first = LeasePool(boxes, _settings(tmp_path), registry=FarmRegistry(tmp_path))
    await first.start()
    await first.wait_warm(5)
    held = await first.lease(owner="alice", ttl_s=20)
    gone = await first.lease()
    await first.release(gone.id)
    await first.wait_warm(5)
    ready_ids = {d["id"] for d in first.status()["desktops"] if d["state"] == "ready"}
    assert ready_ids
    await _crash(first)

    second = LeasePool(boxes, _settings(tmp_path, pool_max=4), registry=FarmRegistry(tmp_path))
    t0 = time.time()
    await second.start()
    try:
        lease = second.get(held.id, owner="alice")
        assert (lease.desktop_id, lease.endpoint, lease.ttl_s) == (held.desktop_id, held.endpoint, 20)
        assert lease.expires_at >= t0 + 20  # a fresh TTL: its holder could not heartbeat a dead farm
        assert set(boxes.adopted) >= {held.desktop_id} | ready_ids
        with pytest.raises(LeaseGone, match="was released"):  # ended leases keep their 410 message
            second.get(gone.id)
        with pytest.raises(UnknownDesktop):
            second.get("nosuchlease000000000000")
        await second.heartbeat(held.id)
        # desktops started after the restart get ids after the adopted ones
        n_started = len(boxes.started)
        for _ in ready_ids:
            await second.lease(wait_s=5)
        await second.wait_warm(5)
        new = boxes.started[n_started:]
        old = {held.desktop_id} | ready_ids
        assert new and all(int(i[1:]) > max(int(o[1:]) for o in old) for i in new), (new, old)
        await second.release(held.id)
        with pytest.raises(LeaseGone):
            second.get(held.id)
    finally:
        await second.close()


async def test_leases_whose_boxes_died_with_the_farm_end_with_a_410_saying_so(tmp_path: Path) -> None:
    boxes = MemoryProvider()
    first = LeasePool(boxes, _settings(tmp_path), registry=FarmRegistry(tmp_path))
    await first.start()
    await first.wait_warm(5)
    a = await first.lease()
    b = await first.lease(wait_s=5)
    await _crash(first)
    boxes.kill(b.desktop_id, "box killed while the farm was down")
    boxes.survives_farm = True

    second = LeasePool(boxes, _settings(tmp_path), registry=FarmRegistry(tmp_path))
    await second.start()
    try:
        assert second.get(a.id).desktop_id == a.desktop_id
        with pytest.raises(LeaseGone, match=rf"lease {b.id} ended: its desktop {b.desktop_id} did not survive "
                                            r"the farm's restart \(its box is gone\); lease a new desktop"):
            second.get(b.id)
    finally:
        await _crash(second)

    boxes.survives_farm = False  # as sandbox boxes: --die-with-parent
    third = LeasePool(boxes, _settings(tmp_path), registry=FarmRegistry(tmp_path))
    await third.start()
    try:
        with pytest.raises(LeaseGone, match="did not survive the farm's restart"):
            third.get(a.id)
        with pytest.raises(LeaseGone, match="its box is gone"):
            third.get(b.id)  # still the first message: an ended lease keeps why it ended
        await third.wait_warm(5)
        assert third.status()["leases"] == 0
    finally:
        await third.close()


async def test_a_graceful_stop_ends_every_lease_and_a_restart_remembers_why(tmp_path: Path) -> None:
    boxes = MemoryProvider()
    first = LeasePool(boxes, _settings(tmp_path), registry=FarmRegistry(tmp_path))
    await first.start()
    await first.wait_warm(5)
    a = await first.lease()
    await first.close()
    second = LeasePool(MemoryProvider(), _settings(tmp_path), registry=FarmRegistry(tmp_path))
    await second.start()
    try:
        with pytest.raises(LeaseGone, match="the farm shut down"):
            second.get(a.id)
        assert second.status()["leases"] == 0 and not [d for d in second.status()["desktops"] if d["state"] == "leased"]
    finally:
        await second.close()


async def test_the_registry_is_private_and_one_farm_per_state_dir(tmp_path: Path) -> None:
    reg = FarmRegistry(tmp_path)
    await reg.open()
    try:
        assert stat.S_IMODE((tmp_path / FILE_NAME).stat().st_mode) == 0o600  # it holds guest tokens
        with pytest.raises(RegistryError, match="another farm uses the state dir"):
            await FarmRegistry(tmp_path).open()
    finally:
        await reg.close()
    # a file that is not a registry: a clear error, not a traceback deep in sqlite
    other = tmp_path / "other"
    other.mkdir()
    (other / FILE_NAME).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(RegistryError, match="not a usable registry"):
        await FarmRegistry(other).open()
    # the schema is what the farm expects
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        assert {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")} >= {
            "desktops", "leases", "ended", "meta"}


# -- real farms, killed -------------------------------------------------------------------------


def _box_pids(state_dir: Path) -> list[int]:
    """Processes of sandbox boxes under ``state_dir`` (their command line names it)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(state_dir) in part for part in (p.info["cmdline"] or [])):
                out.append(p.pid)
    return out


@pytest.fixture
def short_dir() -> Any:
    d = Path(os.environ.get("OSFARM_STATE_DIR") or "/tmp") / f"osfr{os.getpid() % 10000}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(600)
def test_sandbox_farm_killed_its_leases_end_with_a_clear_410_and_nothing_is_left(short_dir: Path) -> None:
    farm = FarmProcess(short_dir, provider="sandbox", pool_min=1, pool_max=2).start()
    try:
        with Farm(farm.url, farm.token) as client:
            desk = client.lease(wait_s=120, ttl_s=300)
            desk.observe(screenshot=False)
            farm_pid = farm.pid
            assert _box_pids(short_dir)
            farm.kill()
            # sandbox boxes die with their farm (parent-death signal): nothing of them is left
            deadline = time.monotonic() + 20
            while [p for p in _box_pids(short_dir) if p != farm_pid] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert [p for p in _box_pids(short_dir) if p != farm_pid] == []
            # a call while the farm is down waits for it (retries), then gets the 410
            restarter = threading.Timer(2.0, farm.start)
            restarter.start()
            try:
                with pytest.raises(LeaseGoneError, match="did not survive the farm's restart") as e:
                    desk.heartbeat()
            finally:
                restarter.join()
            assert e.value.status == 410
            assert "do not outlive their farm" in e.value.detail
            fresh = client.lease(wait_s=120)  # the restarted farm serves new leases
            fresh.observe(screenshot=False)
            fresh.close()
    finally:
        farm.stop()
    assert _box_pids(short_dir) == []


def _docker_ready() -> str | None:
    if shutil.which("docker") is None:
        return "docker CLI missing"
    try:
        import docker

        docker.from_env().images.get("osfarm/desktop:latest")
    except Exception as e:  # noqa: BLE001 - any reason docker cannot run boxes here
        return f"docker or the osfarm/desktop image is unavailable: {e}"
    return None


@pytest.mark.timeout(900)
def test_docker_farm_killed_and_restarted_takes_its_containers_over_and_clients_carry_on(short_dir: Path) -> None:
    why = _docker_ready()
    if why:
        pytest.fail(f"this test needs docker: {why} (make images)")
    farm = FarmProcess(short_dir, provider="docker", pool_min=1, pool_max=2,
                       env={"OSFARM_DOCKER_SHARED_DIR": str(short_dir / "docker")}).start(timeout=300)
    try:
        async def scenario() -> None:
            async with AsyncFarm(farm.url, farm.token) as client:
                desk = await client.lease(wait_s=240, ttl_s=300)
                before = await desk.observe(screenshot=False)
                await asyncio.to_thread(farm.kill)
                # calls made while the farm is down ride out the restart (idempotent: retried)
                restart = asyncio.create_task(asyncio.to_thread(farm.start, 300, False))
                after = await desk.observe(screenshot=False)
                info = await desk.heartbeat()
                await restart
                assert after.screen == before.screen and info.id == desk.id
                r = await desk.step("import os; print(1)", timing="fast")  # the re-adopted desktop still works
                assert r.results and r.results[0].ok, r
                await desk.close()
                with contextlib.suppress(LeaseGoneError):
                    await desk.heartbeat()
        asyncio.run(scenario())
        assert "took over desktops=" in farm.log_tail(20000)
    finally:
        farm.stop(timeout=120)
    import docker

    left = docker.from_env().containers.list(all=True, filters={"label": f"org.osfarm.scope={short_dir / 'docker'}"})
    assert left == []


def test_a_farm_never_reached_fails_at_once_but_a_known_one_is_waited_for(short_dir: Path) -> None:
    t0 = time.monotonic()
    with Farm("http://127.0.0.1:9", "x") as dead, pytest.raises(FarmUnreachableError):
        dead.pool()
    assert time.monotonic() - t0 < 5  # a wrong URL is not retried for a minute
    farm = FarmProcess(short_dir, provider="memory", pool_min=1, pool_max=2).start()
    try:
        with Farm(farm.url, farm.token, retry_s=1.5) as client:
            client.pool()
            farm.kill()
            t0 = time.monotonic()
            with pytest.raises(FarmUnreachableError):
                client.pool()  # retried for retry_s, then given up
            assert 1.0 <= time.monotonic() - t0 < 10
    finally:
        farm.stop()
