"""The warm pool of desktops: boxes started, reset, health-checked and replaced, and handed to
lease requests (the leases themselves are farm/pool.py's).

Desktop lifecycle (``Desktop.state``)::

    starting --> ready --> leased --release/expiry--> resetting --> ready
        |          |          |                            |
        +----------+----------+--crash / start or reset fails---> failed --> stopping --> (gone)

The pool keeps ``pool_min`` desktops ready (leased ones do not count) and never has more than
``pool_max`` desktops at once; a released desktop is reset in the background so the next lease
is answered from a ready desktop without waiting. The health check (``check_health``, run by the
lease pool's loop) asks every desktop's provider and guest (``/v1/health``); a crashed desktop is
replaced and its lease ends (``on_crash``) with a message naming the crash. After this many
start/reset failures in a row (``MAX_START_FAILURES``) lease requests get a 503 at once instead
of waiting for a desktop that will most likely not come.

Threading: everything runs on one asyncio event loop, without locks: state only changes between
awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from osfarm.config import FarmSettings
from osfarm.farm import cpu_accounting, metrics
from osfarm.farm.errors import CapacityError
from osfarm.farm.guest_clients import GuestClients
from osfarm.farm.registry import FarmRegistry
from osfarm.providers.base import DesktopHandle, DesktopSpec, Provider

log = logging.getLogger("osfarm.farm.pool")

STARTING, READY, LEASED, RESETTING, FAILED, STOPPING = (
    "starting", "ready", "leased", "resetting", "failed", "stopping",
)  # fmt: skip
STATES = (STARTING, READY, LEASED, RESETTING, FAILED, STOPPING)
# After this many start/reset failures in a row, lease requests get a 503 at once instead of
# waiting for a desktop that will most likely not come.
MAX_START_FAILURES = 3
BACKOFF_MAX_S = 30.0
# Guest health timeouts/connection errors in a row before a desktop counts as crashed: one slow
# answer under load must not kill a lease. A dead box or a non-200 answer counts at once.
UNREACHABLE_STRIKES = 2


class Clock(Protocol):
    """Where the pool reads the time: wall time for what clients see (lease creation and expiry,
    state timestamps), monotonic time for intervals, deadlines and backoff. Tests pass a clock
    they move by hand, so TTLs, idle stops and backoff are checked without waiting."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass
class Desktop:
    id: str
    state: str
    since: float
    handle: DesktopHandle | None = None
    lease_id: str | None = None
    misses: int = 0  # guest health failures in a row
    resets: int = 0
    created_at: float = -1.0  # when it was first started (default: ``since`` at creation)

    def __post_init__(self) -> None:
        if self.created_at < 0:
            self.created_at = self.since


class DesktopPool:
    """The desktops of one farm (see module doc). ``on_crash(lease_id, message)`` ends the lease
    of a desktop that crashed; ``registry`` (None: memory only) keeps each desktop on disk."""

    def __init__(self, provider: Provider, settings: FarmSettings, clock: Clock, registry: FarmRegistry | None,
                 on_crash: Callable[[str, str], None]):
        self.provider = provider
        self.settings = settings
        self.clock = clock
        self.registry = registry
        self.on_crash = on_crash
        if settings.desktop is None:
            raise ValueError("settings.desktop is None: FarmSettings' validator chooses the desktop; "
                             "these settings were built without validation")
        self.spec = DesktopSpec(
            width=settings.width,
            height=settings.height,
            depth=settings.depth,
            private_network=settings.private_network,
            desktop=settings.desktop,
            timezone=settings.desktop_timezone,
        )
        self.desktops: dict[str, Desktop] = {}
        self.tasks: set[asyncio.Task[Any]] = set()  # background work: starts, resets, stops, client closes
        self.seq = 0  # the number of the last desktop id (d<N>) given out
        self.fail_count = 0  # start/reset failures in a row
        self.last_error = ""
        self.started = False
        self.closed = False
        self._waiters: deque[asyncio.Future[Desktop]] = deque()
        self._box_tasks: dict[str, asyncio.Task[Any]] = {}  # start/reset in flight, by desktop
        self._guests = GuestClients(self.spawn)  # health-check clients, one per box
        self._changed = asyncio.Event()
        self._next_start_at = 0.0
        self._retry_handle: asyncio.TimerHandle | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Begin warming: start desktops up to ``pool_min``."""
        self.started = True
        self.replenish()
        self.publish()

    async def stop_work(self) -> None:
        """Stop handing out and making desktops: waiting requests get a 503, starts and resets
        are cancelled (the provider kills a half-started box), stops finish."""
        self.closed = True
        if self._retry_handle:
            self._retry_handle.cancel()
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(CapacityError("the farm is shutting down", status=503))
        self._waiters.clear()
        for task in self._box_tasks.values():
            task.cancel()
        while self.tasks:  # finishing tasks may spawn small ones (client closes)
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def stop_boxes(self) -> None:
        """Stop every desktop's box (after :meth:`stop_work`)."""
        for d in list(self.desktops.values()):
            if d.handle is not None:
                try:
                    await self.provider.stop(d.handle)
                except Exception:
                    log.exception("stop failed on close desktop=%s", d.id)
            self.desktops.pop(d.id, None)
            if self.registry is not None:
                self.registry.drop_desktop(d.id)
        await self._guests.aclose()
        self.publish()

    async def check_health(self) -> None:
        """Check every ready or leased desktop (a crashed one is replaced, its lease ended), stop
        idle spares, start missing ones."""
        targets = [d for d in self.desktops.values() if d.state in (READY, LEASED) and d.handle is not None]
        results = await asyncio.gather(*(self._check(d) for d in targets))
        for d, (handle, reason, strike) in zip(targets, results, strict=True):
            if d.handle is not handle or d.state not in (READY, LEASED):
                continue  # changed hands during the check (released, reset): result is stale
            if reason is None:
                d.misses = 0
            elif strike:
                d.misses += 1
                if d.misses >= UNREACHABLE_STRIKES:
                    self.fail(d, reason, kind="crashed")
            else:
                self.fail(d, reason, kind="crashed")
        self._scale_down()
        self.replenish()

    async def box_problem(self, desktop_id: str) -> str | None:
        """What the provider says is wrong with a desktop's box (``alive``), or None."""
        d = self.desktops.get(desktop_id)
        if d is None or d.handle is None:
            return None
        try:
            return await self.provider.alive(d.handle)
        except Exception:  # noqa: BLE001 - only a better message; the caller has one already
            return None

    async def wait_warm(self, timeout: float) -> None:
        """Wait until ``pool_min`` desktops are ready; TimeoutError (or CapacityError 503 when
        desktops keep failing to start) otherwise."""
        want = min(self.settings.pool_min, self.settings.pool_max)
        deadline = self.clock.monotonic() + timeout
        while self.count(READY) < want:
            if self.fail_count >= MAX_START_FAILURES and not self.coming():
                raise CapacityError(self._failing_message(), status=503, retry_after_s=self._retry_after())
            left = deadline - self.clock.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"pool not warm after {timeout:g}s: {self.counts()}"
                    + (f"; last start error: {self.last_error}" if self.last_error else "")
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    # -- bookkeeping ------------------------------------------------------------------------

    def count(self, state: str) -> int:
        return sum(1 for d in self.desktops.values() if d.state == state)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for d in self.desktops.values():
            counts[d.state] += 1
        return counts

    def coming(self) -> int:
        """Desktops that are or will soon be ready without a release."""
        return sum(1 for d in self.desktops.values() if d.state in (STARTING, RESETTING))

    def pending_waiters(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def set(self, d: Desktop, state: str) -> None:
        d.state = state
        d.since = self.clock.time()
        self.publish()

    def publish(self) -> None:
        for state, n in self.counts().items():
            metrics.DESKTOPS.labels(state).set(n)
        # Wake everyone waiting for a change (wait_warm); a fresh Event for the next change.
        self._changed.set()
        self._changed = asyncio.Event()

    # -- handing desktops to lease requests -------------------------------------------------

    def take_ready(self) -> Desktop | None:
        for d in self.desktops.values():
            if d.state == READY:
                self.set(d, LEASED)  # reserved; the lease id is filled in by the caller
                return d
        return None

    def _dispatch(self) -> None:
        """Hand ready desktops to waiting lease requests, oldest first."""
        while self._waiters:
            fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            d = self.take_ready()
            if d is None:
                return
            self._waiters.popleft()
            fut.set_result(d)

    async def wait_for_desktop(self, deadline: float, wait_s: float) -> Desktop:
        if (self.fail_count >= MAX_START_FAILURES and not self.coming()
                and self.clock.monotonic() < self._next_start_at):
            raise CapacityError(self._failing_message(), status=503, retry_after_s=self._retry_after())
        fut: asyncio.Future[Desktop] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.replenish()
        try:
            await asyncio.wait({fut}, timeout=max(0.0, deadline - self.clock.monotonic()))
        except asyncio.CancelledError:
            # The requester went away; a desktop already handed to it goes back to ready.
            self._abandon(fut)
            raise
        if not fut.done():
            self._abandon(fut)
            raise self._capacity_error(wait_s)
        return fut.result()  # may raise CapacityError (503) set by a failing start

    def _abandon(self, fut: asyncio.Future[Desktop]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            d = fut.result()
            if d.state == LEASED and d.lease_id is None:
                self.set(d, READY)
                self._dispatch()
        else:
            fut.cancel()

    def _capacity_error(self, wait_s: float) -> CapacityError:
        leased = self.count(LEASED)
        if self.fail_count and leased < self.settings.pool_max:
            return CapacityError(self._failing_message(), status=503, retry_after_s=self._retry_after())
        if leased >= self.settings.pool_max:
            return CapacityError(
                f"all {self.settings.pool_max} desktops are leased (waited {wait_s:g}s); retry later",
                status=429,
                retry_after_s=1.0,
            )
        return CapacityError(
            f"no desktop became ready within {wait_s:g}s ({self.coming()} starting or resetting, "
            f"{leased} of {self.settings.pool_max} leased); retry later",
            status=429,
            retry_after_s=1.0,
        )

    def _failing_message(self) -> str:
        return f"desktops cannot be started ({self.fail_count} failures in a row): {self.last_error}"

    def _retry_after(self) -> float:
        return max(1.0, self._next_start_at - self.clock.monotonic())

    # -- box work (background tasks) ------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, None], desktop_id: str | None = None) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        if desktop_id is not None:
            self._box_tasks[desktop_id] = task

        def done(t: asyncio.Task[None]) -> None:
            self.tasks.discard(t)
            if desktop_id is not None and self._box_tasks.get(desktop_id) is t:
                del self._box_tasks[desktop_id]
            if not t.cancelled() and t.exception() is not None:
                log.error("pool task failed", exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def replenish(self) -> None:
        """Start desktops until pool_min + waiting requests are ready or coming (<= pool_max)."""
        if self.closed or not self.started:
            return
        now = self.clock.monotonic()
        if now < self._next_start_at:
            if self._retry_handle is None:
                loop = asyncio.get_running_loop()
                self._retry_handle = loop.call_later(self._next_start_at - now, self._retry_replenish)
            return
        need = self.settings.pool_min + self.pending_waiters()
        have = self.count(READY) + self.coming()
        while have < need and len(self.desktops) < self.settings.pool_max:
            self.seq += 1
            d = Desktop(id=f"d{self.seq}", state=STARTING, since=self.clock.time())
            self.desktops[d.id] = d
            self.publish()
            self.spawn(self._start_box(d), d.id)
            have += 1

    def _retry_replenish(self) -> None:
        self._retry_handle = None
        self.replenish()

    async def _start_box(self, d: Desktop) -> None:
        t0 = self.clock.monotonic()
        try:
            handle = await self.provider.start(d.id, self.spec)
        except Exception as e:
            self.box_failed(d, e, "start_failed")
            return
        dt = self.clock.monotonic() - t0
        metrics.START_SECONDS.observe(dt)
        cpu_accounting.count_start(self.cpu_seconds(handle))
        log.info("desktop ready desktop=%s start_s=%.3f", d.id, dt)
        self.box_ready(d, handle)

    def recycle(self, d: Desktop) -> None:
        self.drop_client(d.id)
        self.set(d, RESETTING)
        if self.registry is not None:  # a restart reaps a box caught in its reset
            self.registry.put_desktop(d.id, RESETTING, None, d.handle)
        self.spawn(self._reset_box(d), d.id)

    async def _reset_box(self, d: Desktop) -> None:
        assert d.handle is not None
        t0 = self.clock.monotonic()
        cpu_before = self.cpu_seconds(d.handle)
        try:
            handle = await self.provider.reset(d.handle)
        except Exception as e:
            with contextlib.suppress(Exception):
                await self.provider.stop(d.handle)
            self.box_failed(d, e, "reset_failed")
            return
        dt = self.clock.monotonic() - t0
        metrics.RESET_SECONDS.observe(dt)
        self.reset_cpu(cpu_before, handle)
        d.resets += 1
        log.info("desktop reset desktop=%s reset_s=%.3f", d.id, dt)
        self.box_ready(d, handle)

    def box_ready(self, d: Desktop, handle: DesktopHandle) -> None:
        self.fail_count = 0
        self.last_error = ""
        self._next_start_at = 0.0
        d.handle = handle
        d.misses = 0
        self.set(d, READY)
        if self.registry is not None:
            self.registry.put_desktop(d.id, READY, None, handle)
        self._dispatch()

    def box_failed(self, d: Desktop, e: Exception, kind: str) -> None:
        self.fail_count += 1
        text = str(e) or repr(e)
        self.last_error = text if len(text) <= 2000 else text[:600] + "\n...\n" + text[-1400:]
        self._next_start_at = self.clock.monotonic() + min(BACKOFF_MAX_S, 0.5 * 2 ** (self.fail_count - 1))
        metrics.DESKTOP_FAILURES.labels(kind).inc()
        log.error("desktop %s desktop=%s failures=%d error=%s", kind, d.id, self.fail_count, text.splitlines()[0])
        self.desktops.pop(d.id, None)
        if self.registry is not None:
            self.registry.drop_desktop(d.id)
        self.publish()
        if self.fail_count >= MAX_START_FAILURES and not self.coming():
            err = CapacityError(self._failing_message(), status=503, retry_after_s=self._retry_after())
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_exception(err)
        self.replenish()

    def fail(self, d: Desktop, reason: str, kind: str) -> None:
        """A ready or leased desktop crashed: end its lease with the reason, replace it."""
        if d.state in (FAILED, STOPPING):
            return
        metrics.DESKTOP_FAILURES.labels(kind).inc()
        log.warning("desktop failed desktop=%s kind=%s lease=%s reason=%s", d.id, kind, d.lease_id, reason)
        if d.lease_id is not None:
            self.on_crash(d.lease_id, f"desktop {d.id} crashed: {reason}; lease a new desktop")
        self.set(d, FAILED)
        self.spawn(self._remove(d))

    async def _remove(self, d: Desktop) -> None:
        self.set(d, STOPPING)
        self.drop_client(d.id)
        if d.handle is not None:
            try:
                await self.provider.stop(d.handle)
            except Exception:
                log.exception("stop failed desktop=%s", d.id)
        self.desktops.pop(d.id, None)
        if self.registry is not None:
            self.registry.drop_desktop(d.id)
        self.publish()
        self.replenish()

    # -- health -----------------------------------------------------------------------------

    def _scale_down(self) -> None:
        """Stop ready desktops above pool_min that idled for idle_stop_s: the burst that needed
        them is over, and each idle desktop holds ~100-200 MB."""
        spare = self.count(READY) - self.settings.pool_min - self.pending_waiters()
        cutoff = self.clock.time() - self.settings.idle_stop_s
        for d in sorted((d for d in self.desktops.values() if d.state == READY), key=lambda d: d.since):
            if spare <= 0 or d.since > cutoff:
                break
            spare -= 1
            log.info("stopping idle desktop desktop=%s idle_s=%.0f", d.id, self.clock.time() - d.since)
            self.set(d, STOPPING)  # now, so no lease can take it before _remove runs
            self.spawn(self._remove(d))

    async def _check(self, d: Desktop) -> tuple[DesktopHandle, str | None, bool]:
        """(handle checked, failure reason or None, whether it only counts as a strike)."""
        handle = d.handle
        assert handle is not None
        reason = await self.provider.alive(handle)
        if reason:
            return handle, reason, False
        reason, strike = await self._guests.health(d.id, handle)
        return handle, reason, strike

    def drop_client(self, desktop_id: str) -> None:
        self._guests.drop(desktop_id)

    # -- CPU accounting ---------------------------------------------------------------------

    def cpu_seconds(self, handle: DesktopHandle | None) -> float | None:
        """CPU-seconds a box used since it started; None where the provider cannot tell."""
        return cpu_accounting.box_cpu_seconds(self.provider, handle)

    def reset_cpu(self, before: float | None, handle: DesktopHandle) -> None:
        cpu_accounting.count_reset(before, self.cpu_seconds(handle), handle)
