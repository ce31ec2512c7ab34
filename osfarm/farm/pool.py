"""The warm pool of desktops and the leases handed out on them.

Desktop lifecycle (``_Desktop.state``)::

    starting --> ready --> leased --release/expiry--> resetting --> ready
        |          |          |                            |
        +----------+----------+--crash / start or reset fails---> failed --> stopping --> (gone)

The pool keeps ``pool_min`` desktops ready (leased ones do not count) and never has more than
``pool_max`` desktops at once; a released desktop is reset in the background so the next lease
is answered from a ready desktop without waiting. A background loop expires leases whose
heartbeat lapsed and health-checks every desktop (provider + guest ``/v1/health``); a crashed
desktop is replaced and its lease ends with a message naming the crash.

Threading: everything runs on one asyncio event loop; the sync methods (``get``,
``mark_failed``, ``status``) must be called from that loop's thread too. There are no locks:
state only changes between awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from osfarm.config import FarmSettings
from osfarm.farm import cpu_accounting, metrics
from osfarm.farm.errors import Busy, CapacityError, ForeignLease, LeaseGone, QuotaExceeded, ResetFailed, UnknownDesktop
from osfarm.farm.guest_clients import HEALTH_TIMEOUT_S, GuestClients
from osfarm.farm.lease import ControlSpan, Lease, new_lease_id
from osfarm.farm.readopt import take_over
from osfarm.farm.registry import FarmRegistry, SavedLease, Snapshot
from osfarm.providers.base import DesktopHandle, DesktopSpec, GuestEndpoint, Provider

__all__ = ["HEALTH_TIMEOUT_S", "Clock", "ControlSpan", "DesktopView", "Lease", "LeasePool", "SystemClock",
           "new_lease_id"]

log = logging.getLogger("osfarm.farm.pool")

STARTING, READY, LEASED, RESETTING, FAILED, STOPPING = (
    "starting", "ready", "leased", "resetting", "failed", "stopping",
)  # fmt: skip
STATES = (STARTING, READY, LEASED, RESETTING, FAILED, STOPPING)
ENDED_LEASES_KEPT = 10_000
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


@dataclass(frozen=True)
class DesktopView:
    """One desktop as the dashboard shows it (a snapshot, see :meth:`LeasePool.desktops`)."""

    id: str
    state: str
    since: float
    created_at: float
    resets: int
    provider: str | None
    endpoint: GuestEndpoint | None
    screen: tuple[int, int] | None
    lease: Lease | None


@dataclass
class _Desktop:
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


class LeasePool:
    """Warm pool + leases (see module doc). ``close`` also closes the provider."""

    def __init__(self, provider: Provider, settings: FarmSettings, clock: Clock | None = None,
                 registry: FarmRegistry | None = None):
        self.provider = provider
        self.settings = settings
        self.clock: Clock = clock or SystemClock()
        # the lease table and desktop registry on disk (farm/registry.py); None: memory only
        self.registry = registry
        # called (on the loop) with every lease that ends, however: released, expired, crashed
        self.lease_ended: list[Callable[[Lease], None]] = []
        self.spec = DesktopSpec(
            width=settings.width,
            height=settings.height,
            depth=settings.depth,
            private_network=settings.private_network,
            desktop=settings.desktop,
            timezone=settings.desktop_timezone,
        )
        self._desktops: dict[str, _Desktop] = {}
        self._leases: dict[str, Lease] = {}
        self._ended: OrderedDict[str, tuple[str | None, str, str | None]] = OrderedDict()  # owner, why, principal
        self._requesting: dict[str | None, int] = {}  # lease requests in flight per principal (quotas)
        self._waiters: deque[asyncio.Future[_Desktop]] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._box_tasks: dict[str, asyncio.Task[Any]] = {}  # start/reset in flight, by desktop
        self._guests = GuestClients(self._spawn)  # health-check clients, one per box
        self._changed = asyncio.Event()
        self._seq = 0
        self._fail_count = 0
        self._last_error = ""
        self._next_start_at = 0.0
        self._retry_handle: asyncio.TimerHandle | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Take over the desktops and leases a previous farm of this state dir left (with a
        registry), reap the boxes nobody takes over, start the health loop and begin warming."""
        if self._started:
            return
        if self.registry is not None:
            await self._readopt(await self.registry.open())
        reaped = await self.provider.reap_orphans()
        if reaped:
            log.warning("reaped orphan desktops count=%d provider=%s", reaped, self.provider.name)
        self._started = True
        self._health_task = asyncio.create_task(self._health_loop(), name="osfarm-pool-health")
        self._replenish()
        self._publish()

    async def wait_warm(self, timeout: float) -> None:
        """Wait until ``pool_min`` desktops are ready; TimeoutError (or CapacityError 503 when
        desktops keep failing to start) otherwise."""
        want = min(self.settings.pool_min, self.settings.pool_max)
        deadline = self.clock.monotonic() + timeout
        while self._count(READY) < want:
            if self._fail_count >= MAX_START_FAILURES and not self._coming():
                raise CapacityError(self._failing_message(), status=503, retry_after_s=self._retry_after())
            left = deadline - self.clock.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"pool not warm after {timeout:g}s: {self._counts()}"
                    + (f"; last start error: {self._last_error}" if self._last_error else "")
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def close(self) -> None:
        """Stop background work and every desktop, end all leases, close the provider."""
        if self._closed:
            return
        self._closed = True
        if self._retry_handle:
            self._retry_handle.cancel()
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(CapacityError("the farm is shutting down", status=503))
        self._waiters.clear()
        # Starts/resets are cancelled (the provider kills a half-started box); stops finish.
        for task in self._box_tasks.values():
            task.cancel()
        while self._tasks:  # finishing tasks may spawn small ones (client closes)
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for lease in list(self._leases.values()):
            self._end_lease(lease, f"lease {lease.id} ended: the farm shut down")
        for d in list(self._desktops.values()):
            if d.handle is not None:
                try:
                    await self.provider.stop(d.handle)
                except Exception:
                    log.exception("stop failed on close desktop=%s", d.id)
            self._desktops.pop(d.id, None)
            if self.registry is not None:
                self.registry.drop_desktop(d.id)
        await self._guests.aclose()
        self._publish()
        if self.registry is not None:
            await self.registry.close()
        await self.provider.close()
        log.info("pool closed")

    # -- restart ----------------------------------------------------------------------------

    def _save_lease(self, lease: Lease, handle: DesktopHandle | None) -> Future[None]:
        assert self.registry is not None
        data = {"screen": list(lease.screen), "wait_s": lease.wait_s, "provider": lease.provider, "image": lease.image}
        return self.registry.put_lease(lease.id, lease.desktop_id, lease.owner, lease.principal, lease.created_at,
                                       lease.expires_at, lease.ttl_s, data, handle)

    async def _readopt(self, saved: Snapshot) -> None:
        """Take over what the previous farm of this state dir left (its registry ``saved``;
        farm/readopt.py says what comes back): adopted desktops and their leases join the pool,
        every other saved lease ends."""
        assert self.registry is not None
        for e in saved.ended:
            self._ended[e.id] = (e.owner, e.message, e.principal)
        now = self.clock.time()
        got = await take_over(self.provider, self.spec, saved)
        self._seq = max(self._seq, got.last_seq)
        for desktop_id in got.dropped:
            self.registry.drop_desktop(desktop_id)
        for sl, why in got.ended:
            self._end_saved(sl, why)
        for a in got.adopted:
            handle, sl = a.handle, a.lease
            d = _Desktop(id=a.desktop_id, state=LEASED if sl is not None else READY, since=now, handle=handle)
            self._desktops[d.id] = d
            if sl is not None:
                lease = Lease(id=sl.id, desktop_id=d.id, owner=sl.owner, created_at=sl.created_at,
                              expires_at=now + sl.ttl_s, ttl_s=sl.ttl_s, endpoint=handle.endpoint,
                              screen=(handle.spec.width, handle.spec.height), wait_s=float(sl.data.get("wait_s", 0.0)),
                              provider=handle.provider, image=sl.data.get("image"), principal=sl.principal)
                self._leases[lease.id] = lease
                d.lease_id = lease.id
                self._save_lease(lease, handle)
            else:
                self.registry.put_desktop(d.id, READY, None, handle)
        await self.registry.flush()
        self._publish()

    def _end_saved(self, sl: SavedLease, why: str) -> None:
        assert self.registry is not None
        message = f"lease {sl.id} ended: {why}; lease a new desktop"
        self._ended[sl.id] = (sl.owner, message, sl.principal)
        self.registry.end_lease(sl.id, sl.owner, sl.principal, message)

    # -- leases -----------------------------------------------------------------------------

    async def lease(self, owner: str | None = None, ttl_s: float | None = None, wait_s: float = 30.0,
                    principal: str | None = None, max_leases: int | None = None) -> Lease:
        """A lease for ``principal`` (the client's name); with ``max_leases`` it may hold at most
        that many at once, requests still waiting included (QuotaExceeded otherwise)."""
        if self._closed or not self._started:
            raise CapacityError("the farm is not running", status=503)
        if max_leases is not None:
            held = self.leases_held(principal) + self._requesting.get(principal, 0)
            if held >= max_leases:
                raise QuotaExceeded(f"lease quota reached: client {principal!r} holds {held} lease(s) or requests "
                                    f"and may hold {max_leases} at once (max_leases); release one first",
                                    max_leases)
        self._requesting[principal] = self._requesting.get(principal, 0) + 1
        try:
            return await self._lease(owner, ttl_s, wait_s, principal)
        finally:
            self._requesting[principal] -= 1
            if not self._requesting[principal]:
                del self._requesting[principal]

    def lease_ids(self) -> set[str]:
        """Every live lease's id."""
        return set(self._leases)

    def lease_ids_of(self, principal: str | None) -> set[str]:
        return {lease.id for lease in self._leases.values() if lease.principal == principal}

    def leases_held(self, principal: str | None) -> int:
        """Live leases of ``principal`` (expired ones not yet swept count until the next check)."""
        return sum(1 for lease in self._leases.values() if lease.principal == principal)

    async def _lease(self, owner: str | None, ttl_s: float | None, wait_s: float, principal: str | None) -> Lease:
        t0 = self.clock.monotonic()
        ttl = float(ttl_s or self.settings.lease_ttl_s)
        deadline = t0 + max(0.0, wait_s)
        while True:
            d = self._take_ready() if not self._pending_waiters() else None
            if d is None:
                d = await self._wait_for_desktop(deadline, wait_s)
            if d.state == LEASED and d.lease_id is None and d.handle is not None:
                break
            # The reserved desktop crashed between hand-over and now: try again.
        lease = Lease(
            id=new_lease_id(),
            desktop_id=d.id,
            owner=owner,
            created_at=self.clock.time(),
            expires_at=self.clock.time() + ttl,
            ttl_s=ttl,
            endpoint=d.handle.endpoint,
            screen=(d.handle.spec.width, d.handle.spec.height),
            wait_s=self.clock.monotonic() - t0,
            provider=d.handle.provider,
            image=d.handle.info.get("image"),
            desktop=d.handle.spec.desktop,
            principal=principal,
            cpu_mark=self.cpu_seconds(d.handle),
            reset_mode=d.handle.info.get("reset_mode", "start"),
            reset_fallback=d.handle.info.get("reset_fallback_kind"),
        )
        d.lease_id = lease.id
        self._leases[lease.id] = lease
        if self.registry is not None:  # on disk before the client learns the id
            await asyncio.wrap_future(self._save_lease(lease, d.handle))
        metrics.LEASE_WAIT.observe(lease.wait_s)
        self._replenish()  # keep pool_min ready now that one is leased
        log.info(
            "lease granted lease=%s desktop=%s owner=%s ttl_s=%g wait_s=%.4f",
            lease.id[:8], d.id, owner, ttl, lease.wait_s,
        )  # fmt: skip
        return lease

    async def _wait_for_desktop(self, deadline: float, wait_s: float) -> _Desktop:
        if (self._fail_count >= MAX_START_FAILURES and not self._coming()
                and self.clock.monotonic() < self._next_start_at):
            raise CapacityError(self._failing_message(), status=503, retry_after_s=self._retry_after())
        fut: asyncio.Future[_Desktop] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._replenish()
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

    def _abandon(self, fut: asyncio.Future[_Desktop]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            d = fut.result()
            if d.state == LEASED and d.lease_id is None:
                self._set(d, READY)
                self._dispatch()
        else:
            fut.cancel()

    async def release(self, lease_id: str) -> None:
        """End the lease; its desktop is reset in the background. Releasing an ended lease is
        a no-op (DELETE is idempotent); an unknown id raises UnknownDesktop."""
        if lease_id in self._ended:
            return
        try:
            lease = self.get(lease_id)
        except LeaseGone:
            return  # it expired just now; expiry already recycles the desktop
        d = self._desktops.get(lease.desktop_id)
        self._episode_cpu(lease, d)
        self._end_lease(lease, f"lease {lease_id} was released; lease a new desktop")
        if d is not None and d.state == LEASED:
            self._recycle(d)
        if self.registry is not None:  # a restart must not bring the lease back
            await self.registry.flush()
        log.info("lease released lease=%s desktop=%s", lease_id[:8], lease.desktop_id)

    async def heartbeat(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        lease = self.get(lease_id)
        if ttl_s:
            lease.ttl_s = float(ttl_s)
            d = self._desktops.get(lease.desktop_id)
            if self.registry is not None and d is not None:  # a restart gives it this TTL again
                self._save_lease(lease, d.handle)
        lease.expires_at = self.clock.time() + lease.ttl_s
        self.lease_cpu_seconds(lease)
        return lease

    # -- CPU accounting -----------------------------------------------------------------------

    def cpu_seconds(self, handle: DesktopHandle | None) -> float | None:
        """CPU-seconds a box used since it started; None where the provider cannot tell."""
        return cpu_accounting.box_cpu_seconds(self.provider, handle)

    def lease_cpu_seconds(self, lease: Lease) -> float | None:
        """CPU-seconds of the lease's desktop since the lease was granted (``lease.cpu_s``)."""
        d = self._desktops.get(lease.desktop_id)
        now = self.cpu_seconds(d.handle) if d is not None and d.lease_id == lease.id else None
        return cpu_accounting.read_lease_cpu(lease, now)

    def _episode_cpu(self, lease: Lease, d: _Desktop | None) -> None:
        if d is not None and d.lease_id == lease.id and self.lease_cpu_seconds(lease) is not None:
            cpu_accounting.count_episode(lease)

    def _reset_cpu(self, before: float | None, handle: DesktopHandle) -> None:
        cpu_accounting.count_reset(before, self.cpu_seconds(handle), handle)

    async def reset_lease(self, lease_id: str) -> Lease:
        """Give the lease a fresh desktop in place (a provider reset), for a new task.

        While it runs the desktop is ``resetting``: the health loop skips it and a release or
        expiry does not recycle it twice. Raises Busy when a reset of this lease is running,
        LeaseGone when the lease ended meanwhile, ResetFailed (lease ended) when the reset fails.
        """
        lease = self.get(lease_id)
        d = self._desktops.get(lease.desktop_id)
        if d is None or d.handle is None or d.lease_id != lease.id:
            raise LeaseGone(f"lease {lease.id} has no desktop any more; lease a new desktop")
        if d.state != LEASED:
            raise Busy(f"desktop {d.id} is {d.state}: a reset of this lease is already running")
        old = d.handle
        self._drop_client(d.id)
        self._set(d, RESETTING)
        t0 = self.clock.monotonic()
        cpu_before = self.cpu_seconds(old)
        if cpu_before is not None and lease.cpu_mark is not None:
            lease.cpu_acc += max(0.0, cpu_before - lease.cpu_mark)
        try:
            handle = await self.provider.reset(old)
        except BaseException as e:
            with contextlib.suppress(Exception):
                await self.provider.stop(old)
            why = f"{type(e).__name__}: {e}" if isinstance(e, Exception) else "cancelled"
            if lease.id in self._leases:
                self._end_lease(lease, f"desktop {d.id} could not be reset ({why}); lease a new desktop")
            if d.id in self._desktops:
                self._box_failed(d, e if isinstance(e, Exception) else RuntimeError("reset cancelled"), "reset_failed")
            if not isinstance(e, Exception):
                raise
            raise ResetFailed(f"desktop reset failed ({why}); the lease has ended, lease a new desktop") from None
        metrics.RESET_SECONDS.observe(self.clock.monotonic() - t0)
        self._reset_cpu(cpu_before, handle)
        lease.cpu_mark = self.cpu_seconds(handle)
        d.resets += 1
        log.info("leased desktop reset desktop=%s reset_s=%.3f", d.id, self.clock.monotonic() - t0)
        if lease.id not in self._leases or d.lease_id != lease.id:
            self._box_ready(d, handle)  # released or expired meanwhile: back to the pool
            self.get(lease.id)  # raises LeaseGone with the pool's own message
            raise LeaseGone(f"lease {lease.id} ended during the reset; lease a new desktop")
        d.handle, d.misses = handle, 0
        lease.endpoint = handle.endpoint
        lease.reset_mode, lease.reset_fallback = handle.info.get("reset_mode", "start"), handle.info.get(
            "reset_fallback_kind")
        lease.screen = (handle.spec.width, handle.spec.height)
        if self.registry is not None:
            self._save_lease(lease, handle)
        self._set(d, LEASED)
        self._replenish()
        return lease

    def get(self, lease_id: str, owner: str | None = None, principal: str | None = None) -> Lease:
        """The live lease; ``principal`` (a client's name; None: an admin, sees every lease): a lease
        of another client is answered exactly as an unknown id (404), so ids cannot be probed."""
        unknown = UnknownDesktop(f"no desktop lease {lease_id!r}; lease one with POST /v1/desktops")
        lease = self._leases.get(lease_id)
        if lease is not None:
            if principal is not None and lease.principal != principal:
                raise unknown
            if owner is not None and owner != lease.owner:
                raise ForeignLease(f"lease {lease_id} belongs to another owner")
            if self.clock.time() > lease.expires_at:
                self._expire(lease)
            else:
                return lease
        ended = self._ended.get(lease_id)
        if ended is not None:
            ended_owner, message, ended_principal = ended
            if principal is not None and ended_principal != principal:
                raise unknown
            if owner is not None and owner != ended_owner:
                raise ForeignLease(f"lease {lease_id} belongs to another owner")
            raise LeaseGone(message)
        raise unknown

    def ended_message(self, lease_id: str) -> str | None:
        """Why the pool ended a lease (None while it lives): e.g. its health check found the
        desktop over a limit and killed it while a call to the desktop was in flight."""
        ended = self._ended.get(lease_id)
        return ended[1] if ended is not None else None

    async def box_problem(self, desktop_id: str) -> str | None:
        """What the provider says is wrong with a desktop's box (``alive``), or None."""
        d = self._desktops.get(desktop_id)
        if d is None or d.handle is None:
            return None
        try:
            return await self.provider.alive(d.handle)
        except Exception:  # noqa: BLE001 - only a better message; the caller has one already
            return None

    def mark_failed(self, lease_id: str, reason: str) -> None:
        """The API found the guest unreachable: end the lease, replace the desktop."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        d = self._desktops.get(lease.desktop_id)
        if d is not None:
            self._fail(d, reason, kind="unreachable")

    def status(self) -> dict[str, Any]:
        return {
            "desktops": [
                {"id": d.id, "state": d.state, "lease_id": d.lease_id, "since": d.since}
                for d in self._desktops.values()
            ],
            "counts": self._counts(),
            "pool_min": self.settings.pool_min,
            "pool_max": self.settings.pool_max,
            "leases": len(self._leases),
            "waiting": self._pending_waiters(),
            "start_failures": self._fail_count,
            "last_error": self._last_error or None,
        }

    def desktops(self) -> list[DesktopView]:
        """Every desktop with its lease (the dashboard's pool page)."""
        return [self._view(d) for d in self._desktops.values()]

    def desktop(self, desktop_id: str) -> DesktopView | None:
        d = self._desktops.get(desktop_id)
        return self._view(d) if d is not None else None

    def _view(self, d: _Desktop) -> DesktopView:
        h = d.handle
        return DesktopView(
            id=d.id, state=d.state, since=d.since, created_at=d.created_at, resets=d.resets,
            provider=h.provider if h else None, endpoint=h.endpoint if h else None,
            screen=(h.spec.width, h.spec.height) if h else None,
            lease=self._leases.get(d.lease_id) if d.lease_id else None,
        )  # fmt: skip

    # -- bookkeeping ------------------------------------------------------------------------

    def _count(self, state: str) -> int:
        return sum(1 for d in self._desktops.values() if d.state == state)

    def _counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for d in self._desktops.values():
            counts[d.state] += 1
        return counts

    def _coming(self) -> int:
        """Desktops that are or will soon be ready without a release."""
        return sum(1 for d in self._desktops.values() if d.state in (STARTING, RESETTING))

    def _pending_waiters(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def _set(self, d: _Desktop, state: str) -> None:
        d.state = state
        d.since = self.clock.time()
        self._publish()

    def _publish(self) -> None:
        for state, n in self._counts().items():
            metrics.DESKTOPS.labels(state).set(n)
        # Wake everyone waiting for a change (wait_warm); a fresh Event for the next change.
        self._changed.set()
        self._changed = asyncio.Event()

    def _take_ready(self) -> _Desktop | None:
        for d in self._desktops.values():
            if d.state == READY:
                self._set(d, LEASED)  # reserved; the lease id is filled in by the caller
                return d
        return None

    def _dispatch(self) -> None:
        """Hand ready desktops to waiting lease requests, oldest first."""
        while self._waiters:
            fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            d = self._take_ready()
            if d is None:
                return
            self._waiters.popleft()
            fut.set_result(d)

    def _end_lease(self, lease: Lease, message: str) -> None:
        self._leases.pop(lease.id, None)
        self._ended[lease.id] = (lease.owner, message, lease.principal)
        for listener in self.lease_ended:
            listener(lease)
        if self.registry is not None:
            self.registry.end_lease(lease.id, lease.owner, lease.principal, message)
        while len(self._ended) > ENDED_LEASES_KEPT:
            self._ended.popitem(last=False)
        d = self._desktops.get(lease.desktop_id)
        if d is not None and d.lease_id == lease.id:
            d.lease_id = None

    def _expire(self, lease: Lease) -> None:
        self._episode_cpu(lease, self._desktops.get(lease.desktop_id))
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(lease.expires_at))
        self._end_lease(
            lease,
            f"lease {lease.id} expired at {stamp} (no heartbeat within {lease.ttl_s:g}s); lease a new desktop",
        )
        d = self._desktops.get(lease.desktop_id)
        if d is not None and d.state == LEASED:
            self._recycle(d)
        log.info("lease expired lease=%s desktop=%s", lease.id[:8], lease.desktop_id)

    def _capacity_error(self, wait_s: float) -> CapacityError:
        leased = self._count(LEASED)
        if self._fail_count and leased < self.settings.pool_max:
            return CapacityError(self._failing_message(), status=503, retry_after_s=self._retry_after())
        if leased >= self.settings.pool_max:
            return CapacityError(
                f"all {self.settings.pool_max} desktops are leased (waited {wait_s:g}s); retry later",
                status=429,
                retry_after_s=1.0,
            )
        return CapacityError(
            f"no desktop became ready within {wait_s:g}s ({self._coming()} starting or resetting, "
            f"{leased} of {self.settings.pool_max} leased); retry later",
            status=429,
            retry_after_s=1.0,
        )

    def _failing_message(self) -> str:
        return f"desktops cannot be started ({self._fail_count} failures in a row): {self._last_error}"

    def _retry_after(self) -> float:
        return max(1.0, self._next_start_at - self.clock.monotonic())

    # -- box work (background tasks) --------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], desktop_id: str | None = None) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        if desktop_id is not None:
            self._box_tasks[desktop_id] = task

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if desktop_id is not None and self._box_tasks.get(desktop_id) is t:
                del self._box_tasks[desktop_id]
            if not t.cancelled() and t.exception() is not None:
                log.error("pool task failed", exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def _replenish(self) -> None:
        """Start desktops until pool_min + waiting requests are ready or coming (<= pool_max)."""
        if self._closed or not self._started:
            return
        now = self.clock.monotonic()
        if now < self._next_start_at:
            if self._retry_handle is None:
                loop = asyncio.get_running_loop()
                self._retry_handle = loop.call_later(self._next_start_at - now, self._retry_replenish)
            return
        need = self.settings.pool_min + self._pending_waiters()
        have = self._count(READY) + self._coming()
        while have < need and len(self._desktops) < self.settings.pool_max:
            self._seq += 1
            d = _Desktop(id=f"d{self._seq}", state=STARTING, since=self.clock.time())
            self._desktops[d.id] = d
            self._publish()
            self._spawn(self._start_box(d), d.id)
            have += 1

    def _retry_replenish(self) -> None:
        self._retry_handle = None
        self._replenish()

    async def _start_box(self, d: _Desktop) -> None:
        t0 = self.clock.monotonic()
        try:
            handle = await self.provider.start(d.id, self.spec)
        except Exception as e:
            self._box_failed(d, e, "start_failed")
            return
        dt = self.clock.monotonic() - t0
        metrics.START_SECONDS.observe(dt)
        cpu_accounting.count_start(self.cpu_seconds(handle))
        log.info("desktop ready desktop=%s start_s=%.3f", d.id, dt)
        self._box_ready(d, handle)

    def _recycle(self, d: _Desktop) -> None:
        self._drop_client(d.id)
        self._set(d, RESETTING)
        if self.registry is not None:  # a restart reaps a box caught in its reset
            self.registry.put_desktop(d.id, RESETTING, None, d.handle)
        self._spawn(self._reset_box(d), d.id)

    async def _reset_box(self, d: _Desktop) -> None:
        assert d.handle is not None
        t0 = self.clock.monotonic()
        cpu_before = self.cpu_seconds(d.handle)
        try:
            handle = await self.provider.reset(d.handle)
        except Exception as e:
            with contextlib.suppress(Exception):
                await self.provider.stop(d.handle)
            self._box_failed(d, e, "reset_failed")
            return
        dt = self.clock.monotonic() - t0
        metrics.RESET_SECONDS.observe(dt)
        self._reset_cpu(cpu_before, handle)
        d.resets += 1
        log.info("desktop reset desktop=%s reset_s=%.3f", d.id, dt)
        self._box_ready(d, handle)

    def _box_ready(self, d: _Desktop, handle: DesktopHandle) -> None:
        self._fail_count = 0
        self._last_error = ""
        self._next_start_at = 0.0
        d.handle = handle
        d.misses = 0
        self._set(d, READY)
        if self.registry is not None:
            self.registry.put_desktop(d.id, READY, None, handle)
        self._dispatch()

    def _box_failed(self, d: _Desktop, e: Exception, kind: str) -> None:
        self._fail_count += 1
        text = str(e) or repr(e)
        self._last_error = text if len(text) <= 2000 else text[:600] + "\n...\n" + text[-1400:]
        self._next_start_at = self.clock.monotonic() + min(BACKOFF_MAX_S, 0.5 * 2 ** (self._fail_count - 1))
        metrics.DESKTOP_FAILURES.labels(kind).inc()
        log.error("desktop %s desktop=%s failures=%d error=%s", kind, d.id, self._fail_count, text.splitlines()[0])
        self._desktops.pop(d.id, None)
        if self.registry is not None:
            self.registry.drop_desktop(d.id)
        self._publish()
        if self._fail_count >= MAX_START_FAILURES and not self._coming():
            err = CapacityError(self._failing_message(), status=503, retry_after_s=self._retry_after())
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_exception(err)
        self._replenish()

    def _fail(self, d: _Desktop, reason: str, kind: str) -> None:
        """A ready or leased desktop crashed: end its lease with the reason, replace it."""
        if d.state in (FAILED, STOPPING):
            return
        metrics.DESKTOP_FAILURES.labels(kind).inc()
        log.warning("desktop failed desktop=%s kind=%s lease=%s reason=%s", d.id, kind, d.lease_id, reason)
        if d.lease_id is not None and d.lease_id in self._leases:
            self._end_lease(self._leases[d.lease_id], f"desktop {d.id} crashed: {reason}; lease a new desktop")
        self._set(d, FAILED)
        self._spawn(self._remove(d))

    async def _remove(self, d: _Desktop) -> None:
        self._set(d, STOPPING)
        self._drop_client(d.id)
        if d.handle is not None:
            try:
                await self.provider.stop(d.handle)
            except Exception:
                log.exception("stop failed desktop=%s", d.id)
        self._desktops.pop(d.id, None)
        if self.registry is not None:
            self.registry.drop_desktop(d.id)
        self._publish()
        self._replenish()

    # -- health -----------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.tick()
            except Exception:
                log.exception("health tick failed")

    async def tick(self) -> None:
        """One round of the health loop (run every ``health_interval_s``): expire leases whose
        heartbeat lapsed, check every ready or leased desktop, stop idle spares, start missing
        ones."""
        now = self.clock.time()
        for lease in list(self._leases.values()):
            if now > lease.expires_at:
                self._expire(lease)
        targets = [d for d in self._desktops.values() if d.state in (READY, LEASED) and d.handle is not None]
        results = await asyncio.gather(*(self._check(d) for d in targets))
        for d, (handle, reason, strike) in zip(targets, results, strict=True):
            if d.handle is not handle or d.state not in (READY, LEASED):
                continue  # changed hands during the check (released, reset): result is stale
            if reason is None:
                d.misses = 0
            elif strike:
                d.misses += 1
                if d.misses >= UNREACHABLE_STRIKES:
                    self._fail(d, reason, kind="crashed")
            else:
                self._fail(d, reason, kind="crashed")
        self._scale_down()
        self._replenish()

    def _scale_down(self) -> None:
        """Stop ready desktops above pool_min that idled for idle_stop_s: the burst that needed
        them is over, and each idle desktop holds ~100-200 MB."""
        spare = self._count(READY) - self.settings.pool_min - self._pending_waiters()
        cutoff = self.clock.time() - self.settings.idle_stop_s
        for d in sorted((d for d in self._desktops.values() if d.state == READY), key=lambda d: d.since):
            if spare <= 0 or d.since > cutoff:
                break
            spare -= 1
            log.info("stopping idle desktop desktop=%s idle_s=%.0f", d.id, self.clock.time() - d.since)
            self._set(d, STOPPING)  # now, so no lease can take it before _remove runs
            self._spawn(self._remove(d))

    async def _check(self, d: _Desktop) -> tuple[DesktopHandle, str | None, bool]:
        """(handle checked, failure reason or None, whether it only counts as a strike)."""
        handle = d.handle
        assert handle is not None
        reason = await self.provider.alive(handle)
        if reason:
            return handle, reason, False
        reason, strike = await self._guests.health(d.id, handle)
        return handle, reason, strike

    def _drop_client(self, desktop_id: str) -> None:
        self._guests.drop(desktop_id)
