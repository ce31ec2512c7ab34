"""The libvirt provider: one KVM virtual machine per desktop.

Each desktop is a transient libvirt domain (``vm_images/libvirt/domain.xml``, filled in by
:mod:`osfarm.providers.libvirt_domain_xml`) booting the base disk's kernel and initrd directly.
Its disk is a qcow2 overlay on the shared read-only ``base.qcow2`` (``osfarm image build-vm``),
so a fresh disk costs one ``qemu-img create`` (:mod:`osfarm.providers.libvirt_vm_files`).
Inside, ``/sbin/osfarm-init`` starts the desktop session, whose guest server listens on port
8000 of the VM. The VM's only network is qemu user networking (``restrict=on`` unless the spec
asks for a network) and the host reaches the guest through a host forward bound to
``127.0.0.1:<free port>``; nothing on the host talks to the VM's own addresses.

Reset (``libvirt_reset``):

* ``boot`` (default): destroy the VM, new overlay, boot again.
* ``snapshot``: the first start boots, waits until the guest answers, and takes an internal
  snapshot with memory (``ready``) in the overlay; reset reverts to it inside the running qemu
  (``loadvm``) and sets the guest clock through the guest agent, since the reverted guest still
  believes it is the time of the snapshot (:mod:`osfarm.providers.libvirt_snapshot`). The token
  stays the one the VM booted with.

Secrets and ids: the guest's token and the box plan (:mod:`osfarm.desktop.box.box_init`: the agent
runs as ``user`` in its own user namespace inside the VM, apart from the guest, as in every box)
reach the VM through fw_cfg files (``opt/org.osfarm/token``, ``opt/org.osfarm/plan``), which the
VM's root reads from sysfs: never on the kernel command line, which every host user can read in
qemu's ``/proc/<pid>/cmdline``. The host files are deleted once qemu has read them. On
``qemu:///system`` as root, qemu runs as the distribution's unprivileged qemu account
(``libvirt-qemu`` or ``qemu``) when it can reach the VM's files (:func:`qemu_ids`), else as root
with a warning.

Domains carry a ``<metadata>`` element in our namespace naming the farm's state dir (a restarted
farm takes over the domains its registry names, ``adopt``): domains of
this state dir that this provider did not start (a crashed farm's) are destroyed by
``reap_orphans``. One farm per state dir (a lock file), as with the sandbox provider.

Every libvirt call blocks, so each runs in a worker thread (``asyncio.to_thread``;
:mod:`osfarm.providers.libvirt_domains`). The connection and the accelerator (KVM or TCG) come
from :mod:`osfarm.providers.libvirt_host`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

import psutil

from osfarm.config import FarmSettings
from osfarm.images.libvirt_disk import default_image_dir, disk_files, missing_files
from osfarm.providers.base import (
    DesktopHandle,
    DesktopSpec,
    GuestEndpoint,
    ProviderError,
)
from osfarm.providers.boxes import (
    check_desktop_id,
    discarded_on_failure,
    free_loopback_port,
    log_tail,
    remove_stale_dirs,
    take_farm_lock,
    wait_guest_ready,
    wait_pids_gone,
)
from osfarm.providers.libvirt_domain_xml import (
    domain_name,
    domain_template_path,
    domain_xml,
    kernel_cmdline,
    netdev_arg,
    read_metadata,
    vm_plan,
)
from osfarm.providers.libvirt_domains import Domains
from osfarm.providers.libvirt_host import connect, kvm_usable, pick_accel, start_timeout_s
from osfarm.providers.libvirt_snapshot import revert, sync_clock, take_snapshot
from osfarm.providers.libvirt_vm_files import (
    check_free_space,
    fresh_overlay,
    qemu_file,
    qemu_ids,
    qemu_root_and_ids,
)

log = logging.getLogger("osfarm.providers.libvirt")

HEALTH_POLL_S = 0.05
QEMU_CHECK_S = 0.5


@dataclass
class _Box:
    """What the provider keeps about one running VM."""

    name: str
    port: int
    token: str
    qemu_pid: int | None
    snapshot: bool = False


async def _finished_even_if_cancelled(call: Awaitable[Any]) -> Any:
    """Await a call made in a thread; if the caller is cancelled meanwhile, wait for the thread's
    call to end before the CancelledError goes on: a thread cannot be stopped, and what it makes
    (a VM) must exist by the time the caller cleans up."""
    fut = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        if not fut.cancelled():
            fut.exception()  # seen: its failure, if any, is the caller's cleanup's business now
        raise


class LibvirtProvider:
    """Provider protocol implementation with libvirt + qemu/KVM (see module doc)."""

    name = "libvirt"

    def __init__(self, settings: FarmSettings):
        self.settings = settings
        try:
            import libvirt
        except ImportError:
            raise ProviderError(
                "the libvirt Python binding is missing: apt-get install python3-libvirt and use a venv made "
                "with --system-site-packages"
            ) from None
        self._lv = libvirt
        # libvirt prints every error to stderr by default; ours are raised as exceptions.
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        self.image_dir = Path(settings.libvirt_image_dir or default_image_dir()).expanduser().absolute()
        missing = missing_files(self.image_dir)
        if missing:
            raise ProviderError(
                f"no VM base disk in {self.image_dir} (missing {', '.join(Path(m).name for m in missing)}): "
                "build it with `sudo osfarm image build-vm` (or set OSFARM_LIBVIRT_IMAGE_DIR)"
            )
        self.files = disk_files(self.image_dir)
        tpl = domain_template_path()
        try:
            self.template = Template(tpl.read_text())
        except OSError as e:
            raise ProviderError(f"domain template {tpl}: {e.strerror} (set OSFARM_VM_IMAGES to the vm_images dir)"
                                ) from None
        qemu_img = shutil.which("qemu-img")
        if not qemu_img:
            raise ProviderError("qemu-img not found: apt-get install qemu-utils")
        self.qemu_img = qemu_img
        self.state_dir = Path(settings.state_dir).expanduser().absolute()
        self.root = self.state_dir / "libvirt"
        self.root.mkdir(parents=True, exist_ok=True)
        self.root, self.qemu_uid, self.qemu_gid = qemu_root_and_ids(
            self.state_dir, self.root, [self.files["kernel"], self.files["initrd"], self.files["base"]])
        check_free_space(self.root)
        self._lock_fd = self._take_lock()
        try:
            self.conn = connect(libvirt, settings.libvirt_uri)
            self.domain_type = pick_accel(libvirt, self.conn)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.domains = Domains(libvirt, self.conn)
        self.start_timeout_s = start_timeout_s(self.domain_type, settings.start_timeout_s)
        self._boxes: dict[str, _Box] = {}
        self._closed = False

    def _take_lock(self) -> int:
        return take_farm_lock(self.state_dir / "libvirt.lock", f"state_dir {self.state_dir}",
                              "stop it or set a different OSFARM_STATE_DIR")

    def desktop_dir(self, desktop_id: str) -> Path:
        return self.root / desktop_id

    def domain_xml(self, desktop_id: str, spec: DesktopSpec, port: int) -> str:
        return domain_xml(self.template, domain_type=self.domain_type, settings=self.settings,
                          state_dir=self.state_dir, desktop_id=desktop_id, ddir=self.desktop_dir(desktop_id),
                          spec=spec, port=port, files=self.files, qemu_uid=self.qemu_uid, qemu_gid=self.qemu_gid)

    # -- protocol ---------------------------------------------------------------------------

    async def reap_orphans(self) -> int:
        """Destroy domains of this state dir that this provider did not start, and stale dirs."""
        live_names = {b.name for b in self._boxes.values()}
        domains = await asyncio.to_thread(self.domains.osfarm_domains)
        victims = [n for n, m in domains if m.get("state-dir") == str(self.state_dir) and n not in live_names]
        for name in victims:
            await asyncio.to_thread(self.domains.destroy, name)
        stale = await remove_stale_dirs(self.root, self._boxes)
        if victims or stale:
            log.warning("reaped orphan VMs domains=%d stale_dirs=%d state_dir=%s", len(victims), stale, self.state_dir)
        return len(victims)

    async def adopt(self, handle: DesktopHandle) -> DesktopHandle | None:
        """Take over the VM a previous farm of this state dir booted for ``handle`` (the farm
        restarted; libvirt kept the transient domain running). None when it is gone or not ours."""
        name = handle.info.get("domain")
        if self._closed or not name or handle.provider != self.name:
            return None

        def ours() -> bool:
            dom = self.domains.lookup(name)
            if dom is None or not dom.isActive():
                return False
            meta = read_metadata(dom.XMLDesc(0)) or {}
            return meta.get("state-dir") == str(self.state_dir)

        if not await asyncio.to_thread(ours):
            return None
        pid = await asyncio.to_thread(self.domains.qemu_pid, name)
        self._boxes[handle.id] = _Box(name=name, port=_port_of(handle), token=handle.endpoint.token, qemu_pid=pid,
                                      snapshot="snapshot_s" in handle.info)
        handle.pid = pid
        log.info("vm taken over id=%s domain=%s", handle.id, name)
        return handle

    async def start(self, desktop_id: str, spec: DesktopSpec) -> DesktopHandle:
        if self._closed:
            raise ProviderError("libvirt provider is closed")
        check_desktop_id(desktop_id)
        if desktop_id in self._boxes:
            old = self._boxes[desktop_id]
            if await asyncio.to_thread(self.domains.is_active, old.name):
                raise ProviderError(f"desktop {desktop_id} is already running")
            await self._kill(desktop_id)
        t0 = time.monotonic()
        # The boot too: a start cancelled (the farm stopping) while libvirt creates the VM must not
        # leave that VM running (_kill finds it by its domain name).
        async with discarded_on_failure(desktop_id, lambda: self._kill(desktop_id)):
            box = await self._boot(desktop_id, spec)
            handle = self._handle(desktop_id, spec, box)
            await self._wait_ready(handle, box, t0)
            if self.settings.libvirt_reset == "snapshot":
                t_snap = time.monotonic()
                await asyncio.to_thread(take_snapshot, self.domains, box.name)
                box.snapshot = True
                handle.info["snapshot_s"] = f"{time.monotonic() - t_snap:.3f}"
        handle.info["start_s"] = f"{time.monotonic() - t0:.3f}"
        log.info("vm ready id=%s domain=%s port=%d start_s=%s", desktop_id, box.name, box.port, handle.info["start_s"])
        return handle

    def _handle(self, desktop_id: str, spec: DesktopSpec, box: _Box) -> DesktopHandle:
        ddir = self.desktop_dir(desktop_id)
        return DesktopHandle(
            id=desktop_id,
            provider=self.name,
            spec=spec,
            endpoint=GuestEndpoint(base_url=f"http://127.0.0.1:{box.port}", token=box.token),
            pid=box.qemu_pid,
            info={"dir": str(ddir), "log": str(ddir / "console.log"), "domain": box.name,
                  "image": str(self.files["base"]),
                  "accel": self.domain_type, "reset": self.settings.libvirt_reset},
        )  # fmt: skip

    async def _boot(self, desktop_id: str, spec: DesktopSpec) -> _Box:
        ddir = self.desktop_dir(desktop_id)
        await fresh_overlay(self.qemu_img, self.files["base"], ddir, self.qemu_uid, self.qemu_gid)
        token = secrets.token_urlsafe(24)
        # fw_cfg files (see the module doc): read by qemu as it starts, deleted once it runs.
        qemu_file(ddir / "token", token, 0o400, self.qemu_uid, self.qemu_gid)
        qemu_file(ddir / "plan.json", vm_plan(spec).to_json(), 0o400, self.qemu_uid, self.qemu_gid)
        name = domain_name(self.state_dir, desktop_id)
        await asyncio.to_thread(self.domains.destroy, name)  # a leftover of ours with the same name
        last = ""
        for _attempt in range(3):  # the free port may be taken between our probe and qemu's bind
            port = free_loopback_port()
            xml = self.domain_xml(desktop_id, spec, port)
            try:
                await _finished_even_if_cancelled(asyncio.to_thread(self.conn.createXML, xml, 0))
            except self._lv.libvirtError as e:
                last = e.get_error_message()
                if "hostfwd" in last or "Address already in use" in last or "Could not set up host forwarding" in last:
                    continue
                raise ProviderError(f"libvirt could not start desktop {desktop_id}: {last}") from None
            for secret in ("token", "plan.json"):
                (ddir / secret).unlink(missing_ok=True)
            box = _Box(name=name, port=port, token=token, qemu_pid=await asyncio.to_thread(self.domains.qemu_pid, name))
            self._boxes[desktop_id] = box
            return box
        for secret in ("token", "plan.json"):
            (ddir / secret).unlink(missing_ok=True)
        raise ProviderError(f"libvirt could not start desktop {desktop_id}: {last}")

    async def _wait_ready(self, handle: DesktopHandle, box: _Box, t0: float) -> None:
        async def vm_stopped() -> str | None:
            return None if self._qemu_running(box) else "the VM stopped"

        async def console_log() -> str:
            return f"console {handle.info['log']}:\n{log_tail(handle.info['log'], what='console log')}"

        await wait_guest_ready(handle, t0 + self.start_timeout_s, self.start_timeout_s, box_gone=vm_stopped,
                               box_log=console_log, check_box_every_s=QEMU_CHECK_S, poll_s=HEALTH_POLL_S)

    def _qemu_running(self, box: _Box) -> bool:
        if box.qemu_pid is None:
            return self.domains.is_active(box.name)
        try:
            p = psutil.Process(box.qemu_pid)
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    async def reset(self, handle: DesktopHandle) -> DesktopHandle:
        box = self._boxes.get(handle.id)
        if box is not None and box.snapshot and self._qemu_running(box):
            t0 = time.monotonic()
            try:
                how = await asyncio.to_thread(revert, self.domains, box.name)
            except (self._lv.libvirtError, ProviderError) as e:
                msg = e.get_error_message() if isinstance(e, self._lv.libvirtError) else str(e)
                log.warning("snapshot revert of %s failed (%s): booting a fresh VM", handle.id, msg)
            else:
                # libvirt may respawn qemu to revert (when it finds the running config and the
                # snapshot's not ABI-identical): track the current process.
                pid = await asyncio.to_thread(self.domains.qemu_pid, box.name)
                respawned = pid != box.qemu_pid
                box.qemu_pid = pid
                why = await asyncio.to_thread(sync_clock, self.domains, box.name)
                if why:
                    log.warning("guest clock of %s not set after revert: %s", handle.id, why)
                new = self._handle(handle.id, handle.spec, box)
                try:
                    await self._wait_ready(new, box, t0)
                except ProviderError as e:
                    log.warning("desktop %s not ready after revert (%s): booting a fresh VM", handle.id, e)
                else:
                    new.info["start_s"] = f"{time.monotonic() - t0:.3f}"
                    new.info["reset_via"] = "snapshot"
                    new.info["qemu_respawned"] = str(respawned).lower()
                    new.info["revert"] = how
                    return new
        await self._kill(handle.id)
        return await self.start(handle.id, handle.spec)

    async def _kill(self, desktop_id: str) -> None:
        box = self._boxes.pop(desktop_id, None)
        name = box.name if box else domain_name(self.state_dir, desktop_id)
        await asyncio.to_thread(self.domains.destroy, name)
        if box is not None and box.qemu_pid is not None:
            await wait_pids_gone([box.qemu_pid], 10.0)

    async def stop(self, handle: DesktopHandle) -> None:
        await self._kill(handle.id)
        ddir = self.desktop_dir(handle.id)
        if ddir.exists():
            await asyncio.to_thread(shutil.rmtree, ddir, True)
        log.info("vm stopped id=%s", handle.id)

    async def alive(self, handle: DesktopHandle) -> str | None:
        box = self._boxes.get(handle.id)
        if box is None or box.port != _port_of(handle):
            return "VM is not running (stopped or owned by another provider)"
        if not self._qemu_running(box):
            return ("VM stopped (the desktop session exited or qemu died): "
                    f"{log_tail(handle.info.get('log', ''), 3, what='console log')}")
        return None

    def pids(self, handle: DesktopHandle) -> list[int]:
        box = self._boxes.get(handle.id)
        if box is None or box.qemu_pid is None or not self._qemu_running(box):
            return []
        return [box.qemu_pid]

    async def stop_all(self) -> None:
        """Stop every VM this provider started (not part of the protocol: tests, shutdown)."""
        for desktop_id in list(self._boxes):
            await self._kill(desktop_id)
            await asyncio.to_thread(shutil.rmtree, self.desktop_dir(desktop_id), True)

    async def close(self) -> None:
        """Release the libvirt connection and the state_dir lock. Running VMs are not stopped
        (the pool does that); a later farm reaps them."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.conn.close()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def _port_of(handle: DesktopHandle) -> int:
    return int(handle.endpoint.base_url.rsplit(":", 1)[-1])


# Importable from here as before the split (tests and callers import them from this module).
__all__ = ["LibvirtProvider", "domain_name", "kernel_cmdline", "kvm_usable", "netdev_arg", "qemu_ids",
           "read_metadata", "vm_plan"]
