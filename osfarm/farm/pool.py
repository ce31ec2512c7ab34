"""The leases handed out on the farm's warm pool of desktops (farm/desktop_pool.py).

A lease is one client's hold on one desktop until it releases it, its heartbeat lapses
(``ttl_s``) or its desktop crashes; an ended lease's id answers 410 with the reason. A released
or expired lease's desktop is reset in the background and goes back to the pool. A background
loop (``tick``) expires leases whose heartbeat lapsed and health-checks every desktop. With a
registry the leases and desktops are kept on disk, and a farm restarted on the same state dir
takes over what still runs (farm/readopt.py).

Threading: everything runs on one asyncio event loop; the sync methods (``get``,
``mark_failed``, ``status``) must be called from that loop's thread too. There are no locks:
state only changes between awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from osfarm.config import FarmSettings
from osfarm.farm import cpu_accounting, metrics
from osfarm.farm.desktop_pool import LEASED, READY, RESETTING, Clock, Desktop, DesktopPool, SystemClock
from osfarm.farm.errors import Busy, CapacityError, ForeignLease, LeaseGone, QuotaExceeded, ResetFailed, UnknownDesktop
from osfarm.farm.lease import ControlSpan, Lease, new_lease_id
from osfarm.farm.readopt import take_over
from osfarm.farm.registry import FarmRegistry, SavedLease, Snapshot
from osfarm.providers.base import DesktopHandle, GuestEndpoint, Provider

__all__ = ["Clock", "ControlSpan", "DesktopView", "Lease", "LeasePool", "SystemClock", "new_lease_id"]

log = logging.getLogger("osfarm.farm.pool")

ENDED_LEASES_KEPT = 10_000


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


class LeasePool:
    """Leases on a warm pool of desktops (see module doc). ``close`` also closes the provider."""

    def __init__(self, provider: Provider, settings: FarmSettings, clock: Clock | None = None,
                 registry: FarmRegistry | None = None):
        self.provider = provider
        self.settings = settings
        self.clock: Clock = clock or SystemClock()
        # the lease table and desktop registry on disk (farm/registry.py); None: memory only
        self.registry = registry
        # called (on the loop) with every lease that ends, however: released, expired, crashed
        self.lease_ended: list[Callable[[Lease], None]] = []
        self._boxes = DesktopPool(provider, settings, self.clock, registry, on_crash=self._desktop_crashed)
        self.spec = self._boxes.spec
        self._desktops = self._boxes.desktops  # the desktop pool's table, by desktop id
        self._tasks = self._boxes.tasks  # its background work
        self._leases: dict[str, Lease] = {}
        self._ended: OrderedDict[str, tuple[str | None, str, str | None]] = OrderedDict()  # owner, why, principal
        self._requesting: dict[str | None, int] = {}  # lease requests in flight per principal (quotas)
        self._health_task: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Take over the desktops and leases a previous farm of this state dir left (with a
        registry), reap the boxes nobody takes over, start the health loop and begin warming."""
        if self._boxes.started:
            return
        if self.registry is not None:
            await self._readopt(await self.registry.open())
        reaped = await self.provider.reap_orphans()
        if reaped:
            log.warning("reaped orphan desktops count=%d provider=%s", reaped, self.provider.name)
        self._health_task = asyncio.create_task(self._health_loop(), name="osfarm-pool-health")
        self._boxes.start()

    async def wait_warm(self, timeout: float) -> None:
        """Wait until ``pool_min`` desktops are ready; TimeoutError (or CapacityError 503 when
        desktops keep failing to start) otherwise."""
        await self._boxes.wait_warm(timeout)

    async def close(self) -> None:
        """Stop background work and every desktop, end all leases, close the provider."""
        if self._boxes.closed:
            return
        self._boxes.closed = True
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self._boxes.stop_work()
        for lease in list(self._leases.values()):
            self._end_lease(lease, f"lease {lease.id} ended: the farm shut down")
        await self._boxes.stop_boxes()
        if self.registry is not None:
            await self.registry.close()
        await self.provider.close()
        log.info("pool closed")

    async def box_problem(self, desktop_id: str) -> str | None:
        """What the provider says is wrong with a desktop's box (``alive``), or None."""
        return await self._boxes.box_problem(desktop_id)

    def _desktop_crashed(self, lease_id: str, message: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._end_lease(lease, message)

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
        self._boxes.seq = max(self._boxes.seq, got.last_seq)
        for desktop_id in got.dropped:
            self.registry.drop_desktop(desktop_id)
        for ended, why in got.ended:
            self._end_saved(ended, why)
        for a in got.adopted:
            handle, sl = a.handle, a.lease
            d = Desktop(id=a.desktop_id, state=LEASED if sl is not None else READY, since=now, handle=handle)
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
        self._boxes.publish()

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
        if self._boxes.closed or not self._boxes.started:
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
            d = self._boxes.take_ready() if not self._boxes.pending_waiters() else None
            if d is None:
                d = await self._boxes.wait_for_desktop(deadline, wait_s)
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
            try:  # shielded: a write cancelled half-way would break the registry's write order
                await asyncio.shield(asyncio.wrap_future(self._save_lease(lease, d.handle)))
            except asyncio.CancelledError:
                # The requester went away while its lease was written: nobody can learn the id,
                # so the desktop goes back now instead of at the end of the lease's TTL.
                self._end_and_recycle(lease, f"lease {lease.id} was abandoned: its requester went away")
                raise
        metrics.LEASE_WAIT.observe(lease.wait_s)
        self._boxes.replenish()  # keep pool_min ready now that one is leased
        log.info(
            "lease granted lease=%s desktop=%s owner=%s ttl_s=%g wait_s=%.4f",
            lease.id[:8], d.id, owner, ttl, lease.wait_s,
        )  # fmt: skip
        return lease

    async def release(self, lease_id: str) -> None:
        """End the lease; its desktop is reset in the background. Releasing an ended lease is
        a no-op (DELETE is idempotent); an unknown id raises UnknownDesktop."""
        if lease_id in self._ended:
            return
        try:
            lease = self.get(lease_id)
        except LeaseGone:
            return  # it expired just now; expiry already recycles the desktop
        self._end_and_recycle(lease, f"lease {lease_id} was released; lease a new desktop")
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
        self._boxes.drop_client(d.id)
        self._boxes.set(d, RESETTING)
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
                failure = e if isinstance(e, Exception) else RuntimeError("reset cancelled")
                self._boxes.box_failed(d, failure, "reset_failed")
            if not isinstance(e, Exception):
                raise
            raise ResetFailed(f"desktop reset failed ({why}); the lease has ended, lease a new desktop") from None
        metrics.RESET_SECONDS.observe(self.clock.monotonic() - t0)
        self._boxes.reset_cpu(cpu_before, handle)
        lease.cpu_mark = self.cpu_seconds(handle)
        d.resets += 1
        log.info("leased desktop reset desktop=%s reset_s=%.3f", d.id, self.clock.monotonic() - t0)
        if lease.id not in self._leases or d.lease_id != lease.id:
            self._boxes.box_ready(d, handle)  # released or expired meanwhile: back to the pool
            self.get(lease.id)  # raises LeaseGone with the pool's own message
            raise LeaseGone(f"lease {lease.id} ended during the reset; lease a new desktop")
        d.handle, d.misses = handle, 0
        lease.endpoint = handle.endpoint
        lease.reset_mode, lease.reset_fallback = handle.info.get("reset_mode", "start"), handle.info.get(
            "reset_fallback_kind")
        lease.screen = (handle.spec.width, handle.spec.height)
        if self.registry is not None:
            self._save_lease(lease, handle)
        self._boxes.set(d, LEASED)
        self._boxes.replenish()
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

    def mark_failed(self, lease_id: str, reason: str) -> None:
        """The API found the guest unreachable: end the lease, replace the desktop."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        d = self._desktops.get(lease.desktop_id)
        if d is not None:
            self._boxes.fail(d, reason, kind="unreachable")

    def _end_and_recycle(self, lease: Lease, message: str) -> None:
        d = self._desktops.get(lease.desktop_id)
        self._episode_cpu(lease, d)
        self._end_lease(lease, message)
        if d is not None and d.state == LEASED:
            self._boxes.recycle(d)

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
            self._boxes.recycle(d)
        log.info("lease expired lease=%s desktop=%s", lease.id[:8], lease.desktop_id)

    # -- CPU accounting ---------------------------------------------------------------------

    def cpu_seconds(self, handle: DesktopHandle | None) -> float | None:
        """CPU-seconds a box used since it started; None where the provider cannot tell."""
        return self._boxes.cpu_seconds(handle)

    def lease_cpu_seconds(self, lease: Lease) -> float | None:
        """CPU-seconds of the lease's desktop since the lease was granted (``lease.cpu_s``)."""
        d = self._desktops.get(lease.desktop_id)
        now = self.cpu_seconds(d.handle) if d is not None and d.lease_id == lease.id else None
        return cpu_accounting.read_lease_cpu(lease, now)

    def _episode_cpu(self, lease: Lease, d: Desktop | None) -> None:
        if d is not None and d.lease_id == lease.id and self.lease_cpu_seconds(lease) is not None:
            cpu_accounting.count_episode(lease)

    # -- views ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "desktops": [
                {"id": d.id, "state": d.state, "lease_id": d.lease_id, "since": d.since}
                for d in self._desktops.values()
            ],
            "counts": self._boxes.counts(),
            "pool_min": self.settings.pool_min,
            "pool_max": self.settings.pool_max,
            "leases": len(self._leases),
            "waiting": self._boxes.pending_waiters(),
            "start_failures": self._boxes.fail_count,
            "last_error": self._boxes.last_error or None,
        }

    def desktops(self) -> list[DesktopView]:
        """Every desktop with its lease (the dashboard's pool page)."""
        return [self._view(d) for d in self._desktops.values()]

    def desktop(self, desktop_id: str) -> DesktopView | None:
        d = self._desktops.get(desktop_id)
        return self._view(d) if d is not None else None

    def _view(self, d: Desktop) -> DesktopView:
        h = d.handle
        return DesktopView(
            id=d.id, state=d.state, since=d.since, created_at=d.created_at, resets=d.resets,
            provider=h.provider if h else None, endpoint=h.endpoint if h else None,
            screen=(h.spec.width, h.spec.height) if h else None,
            lease=self._leases.get(d.lease_id) if d.lease_id else None,
        )  # fmt: skip

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
        await self._boxes.check_health()
