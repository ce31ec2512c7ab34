"""What the farm's desktops cost in CPU: per box, per lease, per reset, into the farm's metrics.

A box's CPU-seconds come from the provider where it can tell (``SupportsCpuSeconds``: its
cgroup), else from its processes in ``/proc``. A lease counts what its desktop used since the
lease was granted, across resets in place (``Lease.cpu_mark``/``cpu_acc``); accounting never
fails a lease: an unreadable box reads as None.
"""

from __future__ import annotations

from osfarm.farm import metrics
from osfarm.farm.lease import Lease
from osfarm.providers.base import DesktopHandle, Provider, SupportsCpuSeconds, tree_cpu_seconds


def box_cpu_seconds(provider: Provider, handle: DesktopHandle | None) -> float | None:
    """CPU-seconds a box used since it started (its cgroup, else its process tree); None
    where the provider cannot tell."""
    if handle is None:
        return None
    try:
        if isinstance(provider, SupportsCpuSeconds):
            return provider.cpu_seconds(handle)
        return tree_cpu_seconds(provider.pids(handle))
    except Exception:  # noqa: BLE001 - accounting never fails a lease
        return None


def read_lease_cpu(lease: Lease, box_now: float | None) -> float | None:
    """Update ``lease.cpu_s`` from its box's reading now (None: keep the last one); returns it."""
    if box_now is not None and lease.cpu_mark is not None:
        lease.cpu_s = round(lease.cpu_acc + max(0.0, box_now - lease.cpu_mark), 4)
    return lease.cpu_s


def count_start(used: float | None) -> None:
    """Count what a new box used to start."""
    if used is not None:
        metrics.DESKTOP_CPU.labels("start").inc(used)


def count_episode(lease: Lease) -> None:
    """Count a lease's CPU-seconds (its ``cpu_s``, read just now) as one episode."""
    if lease.cpu_s is not None:
        metrics.EPISODE_CPU.observe(lease.cpu_s)
        metrics.DESKTOP_CPU.labels("episode").inc(lease.cpu_s)


def count_reset(before: float | None, after: float | None, handle: DesktopHandle) -> None:
    """Count a reset: its mode, a warm reset's fallback, and its CPU-seconds (a warm reset:
    what the box used during it, ``after - before``; a cold one: what the new box used to
    start). A provider that does not say (libvirt: a reboot or a snapshot revert) made a cold
    one. The CPU-seconds go into ``handle.info["reset_cpu_s"]`` too."""
    mode = handle.info.setdefault("reset_mode", "cold")
    metrics.RESETS.labels(mode).inc()
    if handle.info.get("reset_fallback"):
        metrics.WARM_FALLBACKS.labels(handle.info.get("reset_fallback_kind", "error")).inc()
    if after is None:
        return
    used = after - before if mode == "warm" and before is not None else after
    used = max(0.0, used)
    handle.info["reset_cpu_s"] = f"{used:.4f}"
    metrics.RESET_CPU.labels(mode).observe(used)
    metrics.DESKTOP_CPU.labels("reset").inc(used)
