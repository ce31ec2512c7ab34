"""The lease pool: its state machine first against the in-memory provider and a clock moved by
hand (fast, deterministic: every state, TTL expiry, heartbeats, pool_min/pool_max, crash
replacement, capacity errors, start backoff, idle stops), then over real sandboxes (warm leases,
background resets, expiry, crashes)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from osfarm.config import FarmSettings
from osfarm.farm.errors import Busy, CapacityError, ForeignLease, LeaseGone, UnknownDesktop
from osfarm.farm.metrics import REGISTRY
from osfarm.farm.pool import LeasePool, new_lease_id
from osfarm.providers.sandbox import SANDBOX_ENV, SandboxProvider
from osfarm.providers.sandbox_layout import BOX_PYTHON
from osfarm.testing.boxes import box_processes
from osfarm.testing.memory_provider import MemoryProvider
from osfarm.testing.waiting import async_wait_until as wait_until


def counts(pool: LeasePool) -> dict[str, int]:
    return pool.status()["counts"]


# -- the state machine: in-memory provider, hand-moved clock ------------------------------------------


class HandClock:
    """The pool's clock, moved only by ``advance``."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_700_000_000.0, 1000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@pytest.fixture
async def memory_pool():
    """``make(**settings)`` -> (pool, provider, clock), the pool not started yet. The health
    loop never runs by itself (health_interval_s is an hour): tests call ``pool.tick()``."""
    pools: list[LeasePool] = []

    def make(provider: MemoryProvider | None = None, **kw: Any) -> tuple[LeasePool, MemoryProvider, HandClock]:
        opts: dict[str, Any] = dict(state_dir="/nonexistent", pool_min=1, pool_max=2, lease_ttl_s=30,
                                    idle_stop_s=60, health_interval_s=3600)
        settings = FarmSettings(**{**opts, **kw})
        provider = provider or MemoryProvider()
        clock = HandClock()
        pool = LeasePool(provider, settings, clock)
        pools.append(pool)
        return pool, provider, clock

    yield make
    for pool in pools:
        await pool.close()


async def test_memory_states_starting_ready_leased_resetting_ready(memory_pool) -> None:
    pool, boxes, _ = memory_pool(pool_min=1, pool_max=2)
    with boxes.hold():
        await pool.start()
        assert counts(pool)["starting"] == 1 and counts(pool)["ready"] == 0
    await pool.wait_warm(5)
    assert counts(pool)["ready"] == 1
    lease = await pool.lease(owner="alice")
    assert (lease.owner, lease.provider, lease.image, lease.wait_s) == ("alice", "memory", "memory:1", 0.0)
    assert counts(pool)["leased"] == 1
    await pool.wait_warm(5)  # one more starts: pool_min stay ready while one is leased
    assert counts(pool)["ready"] == 1 and counts(pool)["leased"] == 1
    with boxes.hold():
        await pool.release(lease.id)
        assert counts(pool)["resetting"] == 1
        with pytest.raises(LeaseGone, match="was released"):
            pool.get(lease.id)
        await pool.release(lease.id)  # idempotent
    await wait_until(lambda: counts(pool)["ready"] == 2, 5, "the released desktop back to ready")
    assert boxes.started == ["d1", "d2", "d1"]
    # each lease says how its desktop was made ready (the episode record's desktop_reset)
    assert lease.reset_mode == "start" and lease.reset_fallback is None
    again = [await pool.lease(), await pool.lease()]
    assert sorted((x.desktop_id, x.reset_mode) for x in again) == [("d1", "cold"), ("d2", "start")]


async def test_memory_ttl_expiry_and_heartbeats(memory_pool) -> None:
    pool, boxes, clock = memory_pool(pool_min=1, pool_max=1, lease_ttl_s=30)
    await pool.start()
    await pool.wait_warm(5)
    lease = await pool.lease()
    assert lease.expires_at == clock.time() + 30
    clock.advance(20)
    await pool.heartbeat(lease.id)  # expires 30 s from now
    clock.advance(20)
    assert pool.get(lease.id) is lease  # 40 s after the lease, 20 s after the heartbeat
    await pool.heartbeat(lease.id, ttl_s=5)
    assert lease.ttl_s == 5 and lease.expires_at == clock.time() + 5
    clock.advance(6)
    await pool.tick()  # the health loop expires it and recycles the desktop
    with pytest.raises(LeaseGone, match=r"expired at .* \(no heartbeat within 5s\)"):
        pool.get(lease.id)
    with pytest.raises(LeaseGone):
        await pool.heartbeat(lease.id)
    await wait_until(lambda: counts(pool)["ready"] == 1, 5, "the expired lease's desktop reset")
    assert boxes.started == ["d1", "d1"]
    # Expiry is also noticed on access, between health rounds.
    lease = await pool.lease()
    clock.advance(31)
    with pytest.raises(LeaseGone, match="expired"):
        pool.get(lease.id)


async def test_memory_pool_max_capacity_429_and_waiters(memory_pool) -> None:
    pool, _, _ = memory_pool(pool_min=1, pool_max=2)
    await pool.start()
    a = await pool.lease(owner="a", wait_s=5)
    b = await pool.lease(owner="b", wait_s=5)
    assert counts(pool)["leased"] == 2 and len(pool.status()["desktops"]) == 2  # never above pool_max
    with pytest.raises(CapacityError) as e:
        await pool.lease(wait_s=0)
    assert e.value.status == 429 and "all 2 desktops are leased" in e.value.message and e.value.retry_after_s >= 1
    # A waiting request gets the first desktop that comes back.
    late = asyncio.create_task(pool.lease(owner="late", wait_s=5))
    await wait_until(lambda: pool.status()["waiting"] == 1, 5, "the request to wait")
    await pool.release(a.id)
    c = await late
    assert c.desktop_id == a.desktop_id and c.owner == "late"
    with pytest.raises(ForeignLease):
        pool.get(b.id, owner="mallory")
    with pytest.raises(UnknownDesktop, match="no desktop lease"):
        pool.get("nope")


async def test_memory_dead_box_ends_its_lease_and_is_replaced(memory_pool) -> None:
    pool, boxes, _ = memory_pool(pool_min=1, pool_max=2)
    await pool.start()
    lease = await pool.lease()
    await pool.wait_warm(5)
    boxes.kill(lease.desktop_id, "Xvfb exited")
    await pool.tick()
    with pytest.raises(LeaseGone, match=f"desktop {lease.desktop_id} crashed: Xvfb exited"):
        pool.get(lease.id)
    await wait_until(lambda: lease.desktop_id in boxes.stopped, 5, "the dead box stopped")
    assert lease.desktop_id not in {d["id"] for d in pool.status()["desktops"]}
    await pool.wait_warm(5)
    again = await pool.lease()
    assert again.desktop_id != lease.desktop_id


async def test_memory_silent_guest_fails_on_the_second_strike(memory_pool) -> None:
    pool, boxes, _ = memory_pool(pool_min=1, pool_max=1)
    await pool.start()
    await pool.wait_warm(5)
    await pool.tick()  # a healthy round: the guest answers over HTTP
    assert counts(pool)["ready"] == 1
    boxes.silence("d1")
    await pool.tick()  # one unanswered health check is a strike, not a crash
    assert counts(pool)["ready"] == 1
    await pool.tick()
    await wait_until(lambda: "d1" in boxes.stopped, 5, "the silent box replaced")
    await pool.wait_warm(5)
    assert [d["id"] for d in pool.status()["desktops"]] == ["d2"]


async def test_memory_mark_failed_and_reset_lease(memory_pool) -> None:
    pool, boxes, _ = memory_pool(pool_min=1, pool_max=2)
    await pool.start()
    lease = await pool.lease()
    old = lease.endpoint
    with boxes.hold():
        resetting = asyncio.create_task(pool.reset_lease(lease.id))
        await wait_until(lambda: counts(pool)["resetting"] == 1, 5, "the reset to begin")
        with pytest.raises(Busy):
            await pool.reset_lease(lease.id)
    assert await resetting is lease and lease.endpoint != old and counts(pool)["leased"] == 1
    pool.mark_failed(lease.id, "guest server unreachable: ConnectError")
    with pytest.raises(LeaseGone, match="crashed: guest server unreachable"):
        pool.get(lease.id)


async def test_memory_failing_starts_back_off_answer_503_then_recover(memory_pool) -> None:
    pool, boxes, clock = memory_pool(MemoryProvider(fail_starts=3), pool_min=1, pool_max=2)
    await pool.start()
    await wait_until(lambda: pool.status()["start_failures"] == 1, 5, "the first start to fail")
    await pool.tick()  # within the backoff: nothing starts
    assert pool.status()["start_failures"] == 1 and boxes.fail_starts == 2
    for failures, backoff in ((2, 0.5), (3, 1.0)):
        clock.advance(backoff)
        await pool.tick()
        await wait_until(lambda f=failures: pool.status()["start_failures"] == f, 5, f"start failure {failures}")
    with pytest.raises(CapacityError) as e:
        await pool.lease(wait_s=5)  # answered at once: no desktop is coming
    assert e.value.status == 503 and "3 failures in a row" in e.value.message
    assert "no room for a box" in e.value.message and e.value.retry_after_s >= 1
    with pytest.raises(CapacityError):
        await pool.wait_warm(5)
    clock.advance(2.0)
    await pool.tick()
    await pool.wait_warm(5)
    status = pool.status()
    assert status["start_failures"] == 0 and status["last_error"] is None and counts(pool)["ready"] == 1


async def test_memory_idle_spares_stop_after_idle_stop_s(memory_pool) -> None:
    pool, boxes, clock = memory_pool(pool_min=1, pool_max=3, idle_stop_s=60)
    await pool.start()
    leases = [await pool.lease(wait_s=5) for _ in range(3)]
    for lease in leases:
        await pool.release(lease.id)
    await wait_until(lambda: counts(pool)["ready"] == 3, 5, "three ready desktops")
    clock.advance(59)
    await pool.tick()
    assert counts(pool)["ready"] == 3
    clock.advance(2)
    await pool.tick()  # the burst is over: back to pool_min
    await wait_until(lambda: len(pool.status()["desktops"]) == 1, 5, "idle spares stopped")
    assert len(boxes.boxes) == 1 and counts(pool)["ready"] == 1


async def test_memory_close_ends_leases_stops_boxes_and_the_provider(memory_pool) -> None:
    pool, boxes, _ = memory_pool(MemoryProvider(orphans=2), pool_min=2, pool_max=2)
    await pool.start()
    await pool.wait_warm(5)
    lease = await pool.lease()
    await pool.close()
    assert boxes.closed and boxes.boxes == {} and sorted(boxes.stopped) == ["d1", "d2"]
    with pytest.raises(LeaseGone, match="the farm shut down"):
        pool.get(lease.id)
    with pytest.raises(CapacityError) as e:
        await pool.lease()
    assert e.value.status == 503


# -- over real sandboxes ------------------------------------------------------------------------------


@pytest.fixture
async def make_pool():
    pools: list[tuple[LeasePool, Path]] = []

    async def make(launcher: list[str] | None = None, **kw: Any) -> LeasePool:
        sd = Path(tempfile.mkdtemp(prefix="osf-", dir="/tmp"))
        opts: dict[str, Any] = dict(
            state_dir=sd, width=1024, height=768, health_interval_s=0.2, start_timeout_s=45, pool_min=1, pool_max=2
        )
        opts.update(kw)
        settings = FarmSettings(**opts)
        pool = LeasePool(SandboxProvider(settings, launcher=launcher), settings)
        pools.append((pool, sd))
        await pool.start()
        return pool

    yield make
    for pool, sd in pools:
        await pool.close()
        deadline = time.monotonic() + 5
        while box_processes(sd) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not box_processes(sd), "processes left after pool.close()"
        shutil.rmtree(sd, ignore_errors=True)


async def test_warm_lease_release_reset_cycle(make_pool):
    pool = await make_pool(pool_min=1, pool_max=2)
    await pool.wait_warm(60)
    lease = await pool.lease(owner="alice")
    assert lease.wait_s < 0.05 and lease.owner == "alice" and lease.screen == (1024, 768)
    async with lease.endpoint.client() as c:
        assert (await c.get("/v1/health")).status_code == 200
    assert pool.get(lease.id, owner="alice") is lease
    # The pool tops itself up to pool_min ready while one is leased.
    await pool.wait_warm(60)
    assert counts(pool)["leased"] == 1 and counts(pool)["ready"] == 1

    await pool.release(lease.id)
    assert counts(pool)["resetting"] == 1
    with pytest.raises(LeaseGone, match="was released"):
        pool.get(lease.id)
    await pool.release(lease.id)  # idempotent
    await wait_until(lambda: counts(pool)["ready"] == 2, what="released desktop back to ready")

    # Warm lease latency: a ready desktop is pure bookkeeping.
    times = []
    for _ in range(10):
        await pool.wait_warm(60)
        t0 = time.perf_counter()
        lz = await pool.lease()
        times.append(time.perf_counter() - t0)
        await pool.release(lz.id)
    median = statistics.median(times)
    print(f"\nwarm lease median over {len(times)}: {median * 1000:.3f} ms")
    assert median < 0.05
    text = generate_latest(REGISTRY).decode()
    assert 'osfarm_desktops{state="ready"}' in text and "osfarm_reset_seconds_count" in text


async def test_idle_desktops_above_pool_min_are_stopped(make_pool):
    pool = await make_pool(pool_min=0, pool_max=2, idle_stop_s=1.0)
    a, b = await pool.lease(), await pool.lease()  # a burst: two cold starts
    await pool.release(a.id)
    await pool.release(b.id)
    await wait_until(lambda: counts(pool)["ready"] == 2, 60, "both desktops reset and ready")
    # pool_min is 0: once idle for idle_stop_s, both are stopped and nothing is restarted.
    await wait_until(lambda: not pool.status()["desktops"], 30, "idle desktops stopped")
    assert counts(pool)["ready"] == 0
    c = await pool.lease()  # the pool still serves (a cold start)
    assert pool.get(c.id) is c


async def test_expiry_without_heartbeat_recycles(make_pool):
    pool = await make_pool(pool_min=1, pool_max=1)
    await pool.wait_warm(60)
    lease = await pool.lease(ttl_s=0.8)
    # Heartbeats keep it alive well past the ttl.
    for _ in range(4):
        await asyncio.sleep(0.4)
        hb = await pool.heartbeat(lease.id)
        assert hb.expires_at > time.time() + 0.5
    assert pool.get(lease.id) is lease
    hb = await pool.heartbeat(lease.id, ttl_s=0.5)
    assert hb.ttl_s == 0.5
    # Then it lapses: the background loop ends it and recycles the desktop.
    await wait_until(lambda: counts(pool)["leased"] == 0, timeout=5, what="lease expiry")
    with pytest.raises(LeaseGone, match="expired"):
        pool.get(lease.id)
    with pytest.raises(LeaseGone, match="expired"):
        await pool.heartbeat(lease.id)
    await pool.wait_warm(60)
    assert counts(pool) == {**counts(pool), "ready": 1, "leased": 0}


async def test_capacity_owner_and_unknown_errors(make_pool):
    pool = await make_pool(pool_min=0, pool_max=1)
    lease = await pool.lease(owner="alice", wait_s=60)  # cold: started on demand
    assert lease.wait_s > 0.05
    with pytest.raises(CapacityError) as e:
        await pool.lease(owner="bob", wait_s=0.3)
    assert e.value.status == 429 and "all 1 desktops are leased" in e.value.message
    with pytest.raises(ForeignLease):
        pool.get(lease.id, owner="bob")
    with pytest.raises(UnknownDesktop):
        pool.get("no-such-lease")
    with pytest.raises(UnknownDesktop):
        await pool.release("no-such-lease")

    # A queued request is served by the released desktop once it is reset.
    waiter = asyncio.create_task(pool.lease(owner="bob", wait_s=60))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await pool.release(lease.id)
    second = await waiter
    assert second.desktop_id == lease.desktop_id and second.owner == "bob" and second.wait_s > 0.05
    with pytest.raises(ForeignLease):
        pool.get(lease.id, owner="bob")  # an ended lease still belongs to alice
    with pytest.raises(LeaseGone):
        pool.get(lease.id, owner="alice")
    await pool.release(second.id)


async def test_crashed_desktop_ends_lease_and_is_replaced(make_pool):
    pool = await make_pool(pool_min=1, pool_max=2)
    await pool.wait_warm(60)
    lease = await pool.lease()
    box_dir = f"{pool.provider.state_dir}/sandbox/{lease.desktop_id}"  # type: ignore[attr-defined]
    xvfb = [p for p in box_processes(Path(pool.provider.state_dir)) if p.name() == "Xvfb"  # type: ignore[attr-defined]
            and p.environ().get(SANDBOX_ENV) == box_dir]  # fmt: skip
    assert len(xvfb) == 1
    os.kill(xvfb[0].pid, signal.SIGKILL)

    def gone() -> str | None:
        try:
            pool.get(lease.id)
        except LeaseGone as e:
            return e.message
        return None

    message = await wait_until(gone, timeout=10, what="crash detection")
    assert f"desktop {lease.desktop_id} crashed" in message and "lease a new desktop" in message
    assert "Xvfb" in message or "X server" in message or "exited" in message
    await wait_until(
        lambda: lease.desktop_id not in [d["id"] for d in pool.status()["desktops"]], timeout=10, what="removal"
    )
    await pool.wait_warm(60)  # a replacement is ready
    assert counts(pool)["ready"] >= 1
    assert 'osfarm_desktop_failures_total{reason="crashed"}' in generate_latest(REGISTRY).decode()


async def test_mark_failed_replaces_desktop(make_pool):
    pool = await make_pool(pool_min=1, pool_max=2)
    await pool.wait_warm(60)
    lease = await pool.lease()
    pool.mark_failed(lease.id, "guest unreachable: test")
    with pytest.raises(LeaseGone, match="crashed: guest unreachable: test"):
        pool.get(lease.id)
    await wait_until(lambda: counts(pool)["ready"] >= 1 and counts(pool)["stopping"] == 0, what="replacement")


async def test_failing_starts_give_503_with_the_reason(make_pool):
    # the box runs its own interpreter (the host's venv is not inside it)
    launcher = [BOX_PYTHON, "-c", "import sys; sys.exit('cannot open display: broken on purpose')"]
    pool = await make_pool(launcher=launcher, pool_min=1, pool_max=2)
    with pytest.raises(CapacityError) as e:
        await pool.lease(wait_s=30)
    assert e.value.status == 503
    assert "broken on purpose" in e.value.message and "cannot be started" in e.value.message
    assert pool.status()["start_failures"] >= 3
    with pytest.raises(CapacityError) as e2:
        await pool.wait_warm(30)
    assert e2.value.status == 503


def test_lease_ids_are_one_word_on_any_command_line() -> None:
    # Ids go on command lines (`osfarm desktop release ID`): one that begins with '-' reads as an
    # option there. Over 20 000 draws, the old one-in-64 rate would pass with probability e^-312.
    ids = [new_lease_id() for _ in range(20_000)]
    assert [i for i in ids if i.startswith("-")] == []
    assert all(re.fullmatch(r"[A-Za-z0-9]{24}", i) for i in ids), [i for i in ids if not i.isalnum()][:5]
    assert len(set(ids)) == len(ids)
    # Unguessable: every position spreads over the whole alphabet (24 x log2(62) = 142 bits).
    for pos in range(24):
        assert len({i[pos] for i in ids}) == 62, pos
