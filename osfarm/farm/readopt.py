"""Taking over what the previous farm of a state dir left, when the farm starts again.

A desktop comes back when it was ready, or leased under a live lease, and the provider can
take its box over (``SupportsAdopt``: docker, the container still runs; libvirt, the VM still
runs) and its guest answers; its lease comes back with a fresh TTL (its holder could not
heartbeat a farm that was down). Every other saved lease ends with a 410 saying why; boxes
nobody took over are left to the provider's ``reap_orphans``. Sandbox boxes die with their farm
(a parent-death signal: no daemon keeps them), so a sandbox farm's restart ends every lease.

:func:`take_over` does the box work and decides; the pool (farm/pool.py) puts the result into
its tables and its registry.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

from osfarm.farm.guest_clients import guest_health_problem
from osfarm.farm.registry import SavedLease, Snapshot
from osfarm.providers.base import DesktopHandle, DesktopSpec, Provider, SupportsAdopt

log = logging.getLogger("osfarm.farm.pool")

# the saved states a desktop can come back from (the pool's READY and LEASED)
READY, LEASED = "ready", "leased"


@dataclass
class Adopted:
    """A desktop taken over: its box, and the saved lease it was under (None: it was ready)."""

    desktop_id: str
    handle: DesktopHandle
    lease: SavedLease | None


@dataclass
class TakeOver:
    adopted: list[Adopted] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # desktops not taken over
    ended: list[tuple[SavedLease, str]] = field(default_factory=list)  # saved leases that end, and why
    last_seq: int = 0  # the highest desktop number saved: new ids continue after it


def seq_of(desktop_id: str) -> int:
    """The number of a desktop id ``d<N>`` (0 for other ids): new ids continue after adopted ones."""
    return int(desktop_id[1:]) if desktop_id[:1] == "d" and desktop_id[1:].isdigit() else 0


async def take_over(provider: Provider, spec: DesktopSpec, saved: Snapshot) -> TakeOver:
    """Take over the boxes of ``saved`` (the previous farm's registry) that can come back."""
    leases = {sl.id: sl for sl in saved.leases}
    gone = {e.id for e in saved.ended}
    out = TakeOver()
    for sd in saved.desktops:
        out.last_seq = max(out.last_seq, seq_of(sd.id))
        sl = leases.get(sd.lease_id) if sd.lease_id else None
        handle: DesktopHandle | None = None
        why: str | None = None
        if sd.handle is None or not (sd.state == READY or (sd.state == LEASED and sl is not None)):
            why = f"it was {sd.state} when the farm stopped"
        elif sd.handle.provider != provider.name:
            why = f"the farm now runs the {provider.name} provider, not {sd.handle.provider}"
        elif (sd.handle.spec.width, sd.handle.spec.height) != (spec.width, spec.height):
            why = (f"the farm now makes {spec.width}x{spec.height} desktops, not "
                   f"{sd.handle.spec.width}x{sd.handle.spec.height}")
        elif not isinstance(provider, SupportsAdopt):
            why = f"{provider.name} desktops do not outlive their farm"
        else:
            try:
                handle = await provider.adopt(sd.handle)
            except Exception as e:  # noqa: BLE001 - any failure: the box is not ours to use
                why = f"taking its box over failed: {type(e).__name__}: {e}"
            if handle is None:
                why = why or "its box is gone"
            else:
                why = await guest_health_problem(handle.endpoint)
                if why is not None:
                    with contextlib.suppress(Exception):
                        await provider.stop(handle)
                    handle = None
        if handle is None:
            out.dropped.append(sd.id)
            if sl is not None:
                out.ended.append((sl, f"its desktop {sd.id} did not survive the farm's restart ({why})"))
                gone.add(sl.id)
            log.info("not taken over after the restart desktop=%s why=%s", sd.id, why)
            continue
        out.adopted.append(Adopted(sd.id, handle, sl))
    kept = {a.lease.id for a in out.adopted if a.lease is not None}
    for sl in saved.leases:
        if sl.id not in kept and sl.id not in gone:
            out.ended.append((sl, f"its desktop {sl.desktop_id} was not running when the farm restarted"))
    if saved.desktops or saved.leases:
        log.warning("farm restarted: took over desktops=%d leases=%d; ended leases=%d",
                    len(out.adopted), len(kept), len(saved.leases) - len(kept))
    return out
