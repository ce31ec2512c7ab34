"""The snapshot reset of a desktop VM (``libvirt_reset=snapshot``): an internal snapshot with
memory (``ready``) taken once the guest answers, stored in the VM's overlay; a reset reverts to
it inside the running qemu (``loadvm``), then sets the guest clock through the qemu guest agent,
since the reverted guest still believes it is the time of the snapshot.

Every call blocks: the provider makes each through ``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
import time

from osfarm.providers.base import ProviderError
from osfarm.providers.libvirt_domains import Domains

# The libvirt provider's log: these are its warnings.
log = logging.getLogger("osfarm.providers.libvirt")

SNAPSHOT = "ready"


def take_snapshot(domains: Domains, name: str) -> None:
    """Internal snapshot with memory of the running, ready VM (stored in its overlay)."""
    dom = domains.lookup(name)
    if dom is None:
        raise ProviderError(f"domain {name} vanished before its snapshot")
    xml = (
        f"<domainsnapshot><name>{SNAPSHOT}</name><memory snapshot='internal'/>"
        "<disks><disk name='vda' snapshot='internal'/></disks></domainsnapshot>"
    )
    try:
        dom.snapshotCreateXML(xml, 0)
    except domains.lv.libvirtError as e:
        raise ProviderError(f"snapshot of {name} failed: {e.get_error_message()}") from None


def revert(domains: Domains, name: str) -> str:
    """Revert the running VM to its ``ready`` snapshot; returns how.

    ``loadvm`` in the running qemu first: libvirt's own revert of an active domain stops
    qemu and starts a new one with ``-loadvm`` (firmware, device setup and a fresh process
    on every reset). libvirt's revert stays as the fallback.
    """
    dom = domains.lookup(name)
    if dom is None:
        raise ProviderError(f"domain {name} is gone")
    try:
        import libvirt_qemu

        out = libvirt_qemu.qemuMonitorCommand(
            dom, f"loadvm {SNAPSHOT}", libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP
        )
        if not out.strip():  # HMP answers errors as text, success as nothing
            return "loadvm"
        log.warning("loadvm in %s said %r: using libvirt's revert", name, out.strip()[:200])
    except (ImportError, domains.lv.libvirtError) as e:
        log.warning("loadvm in %s failed (%s): using libvirt's revert", name, e)
    snap = dom.snapshotLookupByName(SNAPSHOT, 0)
    dom.revertToSnapshot(snap, domains.lv.VIR_DOMAIN_SNAPSHOT_REVERT_RUNNING)
    return "libvirt-revert"


def sync_clock(domains: Domains, name: str) -> str | None:
    """Set the reverted guest's clock to now through the guest agent; None or why not."""
    dom = domains.lookup(name)
    if dom is None:
        return "domain is gone"
    last = ""
    for _ in range(60):  # the agent reconnects shortly after a revert
        now = time.time()
        try:
            dom.setTime({"seconds": int(now), "nseconds": int((now % 1) * 1e9)}, 0)
            return None
        except domains.lv.libvirtError as e:
            last = e.get_error_message()
            time.sleep(0.05)
    return last
