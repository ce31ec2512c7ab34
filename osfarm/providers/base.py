"""The provider protocol: how a desktop box is made, reset and destroyed.

A provider starts the same desktop runtime (``osfarm desktop run``) inside some box (a
namespace sandbox, a Docker container, a libvirt VM) and tells the farm how to reach the guest
server inside. The farm's pool owns the lifecycle; a provider only does box work.
"""

from __future__ import annotations

import functools
import os
import ssl
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import httpx

from osfarm.errors import InfraError


class ProviderError(InfraError, RuntimeError):
    """A box could not be made or reached; the message says what is missing and how to fix it."""


@dataclass(frozen=True)
class DesktopSpec:
    width: int = 1920
    height: int = 1080
    depth: int = 24
    private_network: bool = True
    # the session: gnome (OSWorld's Ubuntu GNOME) or light (openbox); osfarm.desktop.session.gnome
    desktop: str = "light"
    timezone: str = "America/Los_Angeles"  # the GNOME desktop's (the light one keeps the host's)
    extra_env: dict[str, str] = field(default_factory=dict)


@functools.cache
def _shared_ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context()


@dataclass(frozen=True)
class GuestEndpoint:
    """How to reach a guest server: a unix socket (``uds``) or a loopback ``base_url``."""

    base_url: str
    token: str
    uds: str | None = None

    def client(self, timeout: float = 60.0) -> httpx.AsyncClient:
        # One shared SSL context: httpx builds (and loads the CA bundle into) a new one per
        # client otherwise, 50-100 ms on the event loop for every box (re)started; a guest is
        # plain HTTP (unix socket or loopback) and never uses it.
        ctx = _shared_ssl_context()
        transport = (httpx.AsyncHTTPTransport(uds=self.uds, verify=ctx) if self.uds
                     else httpx.AsyncHTTPTransport(verify=ctx))
        return httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=timeout,
            verify=ctx,
        )


@dataclass
class DesktopHandle:
    """One running box. ``pid`` is the box's top process on this host (for health and memory)."""

    id: str
    provider: str
    spec: DesktopSpec
    endpoint: GuestEndpoint
    pid: int | None = None
    info: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Provider(Protocol):
    name: str

    async def reap_orphans(self) -> int:
        """Remove boxes left by an earlier farm process (crash, kill -9). Returns how many."""
        ...

    async def start(self, desktop_id: str, spec: DesktopSpec) -> DesktopHandle:
        """Create a fresh box and return once its guest server answers ``/v1/health``."""
        ...

    async def stop(self, handle: DesktopHandle) -> None:
        """Destroy the box; no process of it may survive. Idempotent."""
        ...

    async def reset(self, handle: DesktopHandle) -> DesktopHandle:
        """Return a clean box for the same desktop id (may be a new process/container/VM)."""
        ...

    async def alive(self, handle: DesktopHandle) -> str | None:
        """None if the box looks alive, else a reason such as 'Xvfb exited'."""
        ...

    def pids(self, handle: DesktopHandle) -> list[int]:
        """Host pids of every process of the box (for memory accounting)."""
        ...

    async def close(self) -> None:
        """Release provider resources (not the boxes)."""
        ...


@runtime_checkable
class SupportsAdopt(Protocol):
    """A provider whose boxes outlive their farm (docker containers, libvirt VMs): a farm
    restarted on the same state dir takes over the boxes its registry names."""

    async def adopt(self, handle: DesktopHandle) -> DesktopHandle | None:
        """The box saved as ``handle`` if it still runs and is this provider's to use (its
        handle, possibly refreshed), else None; raises when taking it over failed."""
        ...


@runtime_checkable
class SupportsCpuSeconds(Protocol):
    """A provider that can tell a box's CPU use itself (its cgroup); for the others the farm
    adds up the box's processes (``tree_cpu_seconds`` of ``pids``)."""

    def cpu_seconds(self, handle: DesktopHandle) -> float | None:
        """CPU-seconds the box used since it started; None where it cannot tell."""
        ...


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_seconds(pids: list[int]) -> float | None:
    """CPU-seconds of a set of processes from ``/proc``: each one's user + system time plus
    that of its children it reaped (a box's top process reaps what dies in it); None without
    any readable pid. For providers without a cgroup to ask."""
    total, seen = 0.0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        seen = True
        # after the ")": state is field 3; utime, stime, cutime, cstime are fields 14..17
        total += sum(int(x) for x in fields[11:15]) / _CLK_TCK
    return total if seen else None
