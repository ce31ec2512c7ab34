"""The libvirt provider: one KVM virtual machine per desktop.

Each desktop is a transient libvirt domain (``vm_images/libvirt/domain.xml``) booting the base
disk's kernel and initrd directly. Its disk is a qcow2 overlay on the shared read-only
``base.qcow2`` (``osfarm image build-vm``), so a fresh disk costs one ``qemu-img create``.
Inside, ``/sbin/osfarm-init`` starts the desktop session, whose guest server listens on port
8000 of the VM. The VM's only network is qemu user networking (``restrict=on`` unless the spec
asks for a network) and the host reaches the guest through a host forward bound to
``127.0.0.1:<free port>``; nothing on the host talks to the VM's own addresses.

Reset (``libvirt_reset``):

* ``boot`` (default): destroy the VM, new overlay, boot again.
* ``snapshot``: the first start boots, waits until the guest answers, and takes an internal
  snapshot with memory (``ready``) in the overlay; reset reverts to it inside the running qemu
  (``loadvm``) and sets the guest clock through the guest agent, since the reverted guest still
  believes it is the time of the snapshot. The token stays the one the VM booted with.

Secrets and ids: the guest's token and the box plan (:mod:`osfarm.desktop.box_init`: the agent
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

Every libvirt call blocks, so each runs in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import pwd
import secrets
import shutil
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any
from xml.sax.saxutils import escape

import psutil

from osfarm.config import FarmSettings
from osfarm.desktop import gnome
from osfarm.desktop.agent_world import AgentWorldSpec
from osfarm.desktop.box_init import BoxPlan
from osfarm.desktop.session import home_files
from osfarm.images.libvirt_disk import default_image_dir, disk_files, missing_files
from osfarm.images.recipes import (
    DESKTOP_AGENT_BASE,
    DESKTOP_GUEST_UID,
    DESKTOP_HOME_TEMPLATE,
)
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
from osfarm.providers.cgroups import parse_size

log = logging.getLogger("osfarm.providers.libvirt")

METADATA_NS = "https://osfarm.dev/libvirt/desktop/1"
METADATA_KEY = "osfarm"
GUEST_PORT = 8000
SNAPSHOT = "ready"
HEALTH_POLL_S = 0.05
QEMU_CHECK_S = 0.5
MIN_FREE_BYTES = 2 << 30  # an overlay grows with what a task writes, and a snapshot holds the RAM
TEMPLATE_NAME = "domain.xml"
DOMAIN_PREFIX = "osfarm-"
TCG_MIN_START_TIMEOUT_S = 900.0
QEMU_ACCOUNTS = ("libvirt-qemu", "qemu")  # Debian/Ubuntu, Fedora/RHEL
FW_CFG_TOKEN = "opt/org.osfarm/token"
FW_CFG_PLAN = "opt/org.osfarm/plan"
# The VM's disk is the Docker desktop image's: its accounts and paths.
IMAGE_GUEST_UID = DESKTOP_GUEST_UID
IMAGE_AGENT_BASE = DESKTOP_AGENT_BASE
IMAGE_HOME_TEMPLATE = DESKTOP_HOME_TEMPLATE
QEMU_RUN_ROOT = Path("/var/lib/osfarm/libvirt")  # per-desktop VM files when the state dir is not qemu's to reach
VM_PYTHON = "/opt/osfarm/bin/python"
VM_PATH = "/opt/osfarm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class _Box:
    """What the provider keeps about one running VM."""

    name: str
    port: int
    token: str
    qemu_pid: int | None
    snapshot: bool = False


def domain_template_path() -> Path:
    env = os.environ.get("OSFARM_VM_IMAGES")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "vm_images"
    return root / "libvirt" / TEMPLATE_NAME


def kernel_cmdline(spec: DesktopSpec, home_bytes: int = 1 << 30, tmp_bytes: int = 512 << 20) -> str:
    """Kernel command line of a desktop VM: root disk, our init, the session's settings and the
    sizes of the home and /tmp tmpfs (no secret: the token goes through fw_cfg)."""
    return " ".join(
        [
            "root=/dev/vda", "rw", "rootfstype=ext4", "init=/sbin/osfarm-init",
            "console=ttyS0", "quiet", "loglevel=3", "tsc=reliable", "no_timer_check",
            "random.trust_cpu=on", "8250.nr_uarts=1", "mitigations=off",
            f"osfarm.width={spec.width}", f"osfarm.height={spec.height}",
            f"osfarm.depth={spec.depth}", f"osfarm.port={GUEST_PORT}",
            f"osfarm.home_size={home_bytes}", f"osfarm.tmp_size={tmp_bytes}",
        ]
    )  # fmt: skip


def vm_plan(spec: DesktopSpec) -> BoxPlan:
    """What the VM's init (as the VM's root) does before the session: as the Docker desktop's
    (the VM's disk is that image's), the guest listening on the VM's network for the host forward."""
    args = ["--width", str(spec.width), "--height", str(spec.height), "--depth", str(spec.depth),
            "--desktop", spec.desktop,
            "--display", ":0", "--host", "0.0.0.0", "--port", str(GUEST_PORT), "--allow-non-loopback",
            "--token-file", "/run/osfarm/token", "--state-file", "/run/osfarm/state.json",
            "--run-dir", "/run/osfarm", "--home", "/home/user"]
    env = {"PATH": VM_PATH, "HOME": "/home/user", "USER": "osfarm-guest", "LANG": "C.UTF-8",
           "PYTHONUNBUFFERED": "1", "OSFARM_PYTHON": VM_PYTHON,
           "XDG_CACHE_HOME": "/run/osfarm/cache", "XDG_CONFIG_HOME": "/run/osfarm/config", **spec.extra_env}
    agent = AgentWorldSpec(guest_uid=IMAGE_GUEST_UID, guest_gid=IMAGE_GUEST_UID, outside_base=IMAGE_AGENT_BASE,
                           password_hash="", hostname="osfarm-vm")
    return BoxPlan(
        launcher=[VM_PYTHON, "-m", "osfarm.desktop.launcher", *args], env=env,
        guest_uid=IMAGE_GUEST_UID, guest_gid=IMAGE_GUEST_UID, run_dir="/run/osfarm",
        home="/home/user", home_uid=IMAGE_AGENT_BASE + 1000, home_gid=IMAGE_AGENT_BASE + 1000,
        home_template=IMAGE_HOME_TEMPLATE, home_files=home_files(spec.desktop),
        etc_files=gnome.timezone_files(spec.timezone) if spec.desktop == "gnome" else {}, agent=agent, cwd="/home/user",
    )  # fmt: skip


def qemu_ids(paths: list[Path]) -> tuple[int, int, str]:
    """(uid, gid, note) qemu runs as. A root farm on qemu:///system gives qemu the distribution's
    unprivileged account (and its group, which may use /dev/kvm) when that account can reach every
    file of the VM (``paths``: the farm chowns its own per-desktop files to it); else qemu runs
    as this process's ids, and ``note`` says why."""
    if os.geteuid() != 0:
        return os.getuid(), os.getgid(), ""
    for name in QEMU_ACCOUNTS:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        gids = {pw.pw_gid, *os.getgrouplist(name, pw.pw_gid)}
        blocked = [p for p in paths if not _reachable(p, pw.pw_uid, gids)]
        if blocked:
            return 0, 0, (f"qemu runs as root: the {name} account cannot reach {blocked[0]} (every dir above it "
                          "must be searchable by it; put state_dir and the VM disk under e.g. /var/lib/osfarm)")
        return pw.pw_uid, pw.pw_gid, ""
    return 0, 0, f"qemu runs as root: no unprivileged qemu account ({', '.join(QEMU_ACCOUNTS)}) on this host"


def _reachable(path: Path, uid: int, gids: set[int]) -> bool:
    """Whether ``uid`` may search every dir down to ``path`` and read ``path``."""
    def allowed(st: os.stat_result, bit: int) -> bool:
        if st.st_uid == uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid in gids:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)

    try:
        parts = path.resolve().parts
        for i in range(1, len(parts)):
            if not allowed(os.stat(Path(*parts[:i])), 0o1):
                return False
        return allowed(os.stat(path), 0o4)
    except OSError:
        return False


def netdev_arg(host_port: int, private_network: bool) -> str:
    """qemu user networking; the host forward is bound to loopback only. ``restrict=on`` cuts
    the guest off from the host and the outside (the forward still works)."""
    restrict = "on" if private_network else "off"
    return f"user,id=osfarmnet0,restrict={restrict},hostfwd=tcp:127.0.0.1:{host_port}-:{GUEST_PORT}"


def kvm_usable() -> str | None:
    """None when /dev/kvm can run our VMs, else why not."""
    if not os.path.exists("/dev/kvm"):
        return "/dev/kvm does not exist (no hardware virtualisation, or the kvm module is not loaded)"
    if os.path.isdir("/sys/module/kvm_pvm"):
        # PVM (nested virtualisation without hardware support) only runs guest kernels built
        # for it; a stock Debian kernel hangs right after its decompressor.
        return "/dev/kvm is KVM-PVM, which boots only PVM guest kernels"
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"/dev/kvm cannot be opened: {e.strerror} (add this user to the kvm group)"
    os.close(fd)
    return None


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


def domain_name(state_dir: Path, desktop_id: str) -> str:
    """Unique per farm state dir, so that two farms on one libvirtd never clash."""
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:8]
    return f"{DOMAIN_PREFIX}{digest}-{desktop_id}"


def read_metadata(xml_text: str) -> dict[str, str] | None:
    """Our metadata of a domain (from its XML), or None when it is not an osfarm domain."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError:
        return None
    node = root.find(f"metadata/{{{METADATA_NS}}}desktop")
    if node is None:
        return None
    return {child.tag.split("}", 1)[-1]: (child.text or "") for child in node}


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
        self.qemu_img = shutil.which("qemu-img")
        if not self.qemu_img:
            raise ProviderError("qemu-img not found: apt-get install qemu-utils")
        self.state_dir = Path(settings.state_dir).expanduser().absolute()
        self.root = self.state_dir / "libvirt"
        self.root.mkdir(parents=True, exist_ok=True)
        self.qemu_uid, self.qemu_gid, note = qemu_ids([self.files["kernel"], self.files["initrd"], self.files["base"],
                                                       self.root])
        if note and os.geteuid() == 0 and self.qemu_uid == 0 and "cannot reach" in note:
            # The state dir is private (e.g. under /root or a 0700 temp dir): the VMs' own files
            # go where the qemu account can reach them, named after this state dir.
            alt = QEMU_RUN_ROOT / hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]
            alt.mkdir(parents=True, exist_ok=True)
            for d in (QEMU_RUN_ROOT.parent, QEMU_RUN_ROOT, alt):
                d.chmod(0o711)
            uid, gid, alt_note = qemu_ids([self.files["kernel"], self.files["initrd"], self.files["base"], alt])
            if not alt_note:
                self.root, self.qemu_uid, self.qemu_gid, note = alt, uid, gid, ""
        if note:
            log.warning("%s", note)
        free = shutil.disk_usage(self.root).free
        if free < MIN_FREE_BYTES:
            raise ProviderError(
                f"only {free / 2**30:.1f} GiB free in {self.root}: desktop overlays need at least "
                f"{MIN_FREE_BYTES / 2**30:.0f} GiB; free some space or set OSFARM_STATE_DIR elsewhere"
            )
        self._lock_fd = self._take_lock()
        try:
            self.conn = self._connect(settings.libvirt_uri)
            self.domain_type = self._pick_accel()
        except BaseException:
            os.close(self._lock_fd)
            raise
        # Under TCG a desktop VM boots in minutes: the farm's start timeout (sized for boxes that
        # start in seconds) would fail every start.
        self.start_timeout_s = settings.start_timeout_s
        if self.domain_type != "kvm" and self.start_timeout_s < TCG_MIN_START_TIMEOUT_S:
            self.start_timeout_s = TCG_MIN_START_TIMEOUT_S
        self._boxes: dict[str, _Box] = {}
        self._closed = False

    # -- setup ------------------------------------------------------------------------------

    def _take_lock(self) -> int:
        return take_farm_lock(self.state_dir / "libvirt.lock", f"state_dir {self.state_dir}",
                              "stop it or set a different OSFARM_STATE_DIR")

    def _connect(self, uri: str) -> Any:
        try:
            conn = self._lv.open(uri)
        except self._lv.libvirtError as e:
            raise ProviderError(
                f"cannot connect to libvirt at {uri}: {e.get_error_message()}. Start the daemons "
                "(`sudo bash scripts/setup-libvirt.sh`, or `systemctl start libvirtd virtlogd`) "
                "or set OSFARM_LIBVIRT_URI"
            ) from None
        if conn is None:
            raise ProviderError(f"cannot connect to libvirt at {uri}")
        return conn

    def _pick_accel(self) -> str:
        forced = os.environ.get("OSFARM_LIBVIRT_ACCEL", "auto")
        if forced not in ("auto", "kvm", "tcg"):
            raise ProviderError(f"OSFARM_LIBVIRT_ACCEL={forced!r}: use auto, kvm or tcg")
        if forced == "kvm":
            return "kvm"
        why = kvm_usable() if forced == "auto" else "OSFARM_LIBVIRT_ACCEL=tcg"
        if why is None:
            try:
                self.conn.getDomainCapabilities(None, "x86_64", None, "kvm", 0)
                return "kvm"
            except self._lv.libvirtError as e:
                why = f"libvirt cannot use KVM: {e.get_error_message()}"
        log.warning("KVM is not usable (%s): desktop VMs run under TCG emulation, many times slower", why)
        return "qemu"

    # -- paths and XML ----------------------------------------------------------------------

    def desktop_dir(self, desktop_id: str) -> Path:
        return self.root / desktop_id

    def domain_xml(self, desktop_id: str, spec: DesktopSpec, port: int) -> str:
        ddir = self.desktop_dir(desktop_id)
        if self.domain_type == "kvm":
            # arch-capabilities off: nested KVM hosts often refuse its MSR (qemu aborts at start).
            cpu = ("<cpu mode='host-passthrough' check='none' migratable='off'>"
                   "<feature policy='disable' name='arch-capabilities'/></cpu>")
        else:
            # Every feature TCG can emulate: wheels such as numpy need at least x86-64-v2, which
            # the default qemu64 model lacks (the session dies with SIGILL).
            cpu = "<cpu mode='maximum' check='none'/>"
        mac = "52:54:00:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(3))
        values = {
            "domain_type": self.domain_type,
            "name": domain_name(self.state_dir, desktop_id),
            "metadata_ns": METADATA_NS,
            "desktop_id": desktop_id,
            "state_dir": str(self.state_dir),
            "host_port": str(port),
            "guest_port": str(GUEST_PORT),
            "owner_pid": str(os.getpid()),
            "memory_mb": str(self.settings.libvirt_memory_mb),
            "vcpus": str(self.settings.libvirt_vcpus),
            "kernel": str(self.files["kernel"]),
            "initrd": str(self.files["initrd"]),
            "cmdline": kernel_cmdline(spec, parse_size(self.settings.sandbox_home_size),
                                      parse_size(self.settings.sandbox_tmp_size)),
            "uid": str(self.qemu_uid),
            "gid": str(self.qemu_gid),
            "token_file": str(ddir / "token"),
            "plan_file": str(ddir / "plan.json"),
            "fw_cfg_token": FW_CFG_TOKEN,
            "fw_cfg_plan": FW_CFG_PLAN,
            "overlay": str(ddir / "disk.qcow2"),
            "console_log": str(ddir / "console.log"),
            "netdev": netdev_arg(port, spec.private_network),
            "mac": mac,
        }
        escaped = {k: escape(v, {"'": "&apos;", '"': "&quot;"}) for k, v in values.items()}
        escaped["cpu"] = cpu
        return self.template.substitute(escaped)

    # -- libvirt helpers (blocking: call through asyncio.to_thread) -------------------------

    def _lookup(self, name: str) -> Any | None:
        try:
            return self.conn.lookupByName(name)
        except self._lv.libvirtError as e:
            if e.get_error_code() == self._lv.VIR_ERR_NO_DOMAIN:
                return None
            raise

    def _destroy(self, name: str) -> None:
        dom = self._lookup(name)
        if dom is None:
            return
        with contextlib.suppress(self._lv.libvirtError):
            dom.destroy()
        # Persistent domains (defined by someone by hand) would stay listed: undefine them too.
        with contextlib.suppress(self._lv.libvirtError):
            if dom.isPersistent():
                dom.undefineFlags(self._lv.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA)

    def _qemu_pid(self, name: str) -> int | None:
        """qemu's pid, from libvirt's pid file (qemu:///system) or the process table."""
        for path in (Path("/run/libvirt/qemu") / f"{name}.pid", Path.home() / f".cache/libvirt/qemu/run/{name}.pid"):
            with contextlib.suppress(OSError, ValueError):
                return int(path.read_text().strip())
        for p in psutil.process_iter(["name", "cmdline"]):
            cmd = p.info["cmdline"] or []
            if p.info["name"] and p.info["name"].startswith("qemu") and f"guest={name}," in " ".join(cmd):
                return p.pid
        return None

    def _osfarm_domains(self) -> list[tuple[str, dict[str, str]]]:
        out = []
        for dom in self.conn.listAllDomains(0):
            try:
                meta = read_metadata(dom.XMLDesc(0))
            except self._lv.libvirtError:
                continue  # vanished meanwhile
            if meta is not None:
                out.append((dom.name(), meta))
        return out

    # -- protocol ---------------------------------------------------------------------------

    async def reap_orphans(self) -> int:
        """Destroy domains of this state dir that this provider did not start, and stale dirs."""
        live_names = {b.name for b in self._boxes.values()}
        domains = await asyncio.to_thread(self._osfarm_domains)
        victims = [n for n, m in domains if m.get("state-dir") == str(self.state_dir) and n not in live_names]
        for name in victims:
            await asyncio.to_thread(self._destroy, name)
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
            dom = self._lookup(name)
            if dom is None or not dom.isActive():
                return False
            meta = read_metadata(dom.XMLDesc(0)) or {}
            return meta.get("state-dir") == str(self.state_dir)

        if not await asyncio.to_thread(ours):
            return None
        pid = await asyncio.to_thread(self._qemu_pid, name)
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
            if await asyncio.to_thread(self._is_active, old.name):
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
                await asyncio.to_thread(self._take_snapshot, box.name)
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

    async def _fresh_overlay(self, ddir: Path) -> None:
        """A new qcow2 overlay on the read-only base (old disk and log removed), and the console
        log, both qemu's (it may run as an unprivileged account, see :func:`qemu_ids`)."""
        ddir.mkdir(parents=True, exist_ok=True)
        ddir.chmod(0o711)
        for name in ("disk.qcow2", "console.log", "token", "plan.json"):
            (ddir / name).unlink(missing_ok=True)
        proc = await asyncio.create_subprocess_exec(
            self.qemu_img, "create", "-q", "-f", "qcow2", "-b", str(self.files["base"]), "-F", "qcow2",
            str(ddir / "disk.qcow2"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise ProviderError(f"qemu-img create of the overlay in {ddir} failed: "
                                f"{out.decode(errors='replace').strip()}")
        self._qemu_file(ddir / "disk.qcow2", None, 0o600)
        self._qemu_file(ddir / "console.log", "", 0o600)

    def _qemu_file(self, path: Path, text: str | None, mode: int) -> None:
        """A file qemu opens: written here (``text``; None: it exists), then made qemu's."""
        if text is not None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        if os.geteuid() == 0:
            os.chown(path, self.qemu_uid, self.qemu_gid)
        os.chmod(path, mode)

    async def _boot(self, desktop_id: str, spec: DesktopSpec) -> _Box:
        ddir = self.desktop_dir(desktop_id)
        await self._fresh_overlay(ddir)
        token = secrets.token_urlsafe(24)
        # fw_cfg files (see the module doc): read by qemu as it starts, deleted once it runs.
        self._qemu_file(ddir / "token", token, 0o400)
        self._qemu_file(ddir / "plan.json", vm_plan(spec).to_json(), 0o400)
        name = domain_name(self.state_dir, desktop_id)
        await asyncio.to_thread(self._destroy, name)  # a leftover of ours with the same name
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
            box = _Box(name=name, port=port, token=token, qemu_pid=await asyncio.to_thread(self._qemu_pid, name))
            self._boxes[desktop_id] = box
            return box
        for secret in ("token", "plan.json"):
            (ddir / secret).unlink(missing_ok=True)
        raise ProviderError(f"libvirt could not start desktop {desktop_id}: {last}")

    def _is_active(self, name: str) -> bool:
        dom = self._lookup(name)
        try:
            return bool(dom is not None and dom.isActive())
        except self._lv.libvirtError:
            return False

    async def _wait_ready(self, handle: DesktopHandle, box: _Box, t0: float) -> None:
        async def vm_stopped() -> str | None:
            return None if self._qemu_running(box) else "the VM stopped"

        async def console_log() -> str:
            return f"console {handle.info['log']}:\n{log_tail(handle.info['log'], what='console log')}"

        await wait_guest_ready(handle, t0 + self.start_timeout_s, self.start_timeout_s, box_gone=vm_stopped,
                               box_log=console_log, check_box_every_s=QEMU_CHECK_S, poll_s=HEALTH_POLL_S)

    def _qemu_running(self, box: _Box) -> bool:
        if box.qemu_pid is None:
            return self._is_active(box.name)
        try:
            p = psutil.Process(box.qemu_pid)
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _take_snapshot(self, name: str) -> None:
        """Internal snapshot with memory of the running, ready VM (stored in its overlay)."""
        dom = self._lookup(name)
        if dom is None:
            raise ProviderError(f"domain {name} vanished before its snapshot")
        xml = (
            f"<domainsnapshot><name>{SNAPSHOT}</name><memory snapshot='internal'/>"
            "<disks><disk name='vda' snapshot='internal'/></disks></domainsnapshot>"
        )
        try:
            dom.snapshotCreateXML(xml, 0)
        except self._lv.libvirtError as e:
            raise ProviderError(f"snapshot of {name} failed: {e.get_error_message()}") from None

    def _revert(self, name: str) -> str:
        """Revert the running VM to its ``ready`` snapshot; returns how.

        ``loadvm`` in the running qemu first: libvirt's own revert of an active domain stops
        qemu and starts a new one with ``-loadvm`` (firmware, device setup and a fresh process
        on every reset). libvirt's revert stays as the fallback.
        """
        dom = self._lookup(name)
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
        except (ImportError, self._lv.libvirtError) as e:
            log.warning("loadvm in %s failed (%s): using libvirt's revert", name, e)
        snap = dom.snapshotLookupByName(SNAPSHOT, 0)
        dom.revertToSnapshot(snap, self._lv.VIR_DOMAIN_SNAPSHOT_REVERT_RUNNING)
        return "libvirt-revert"

    def _sync_clock(self, name: str) -> str | None:
        """Set the reverted guest's clock to now through the guest agent; None or why not."""
        dom = self._lookup(name)
        if dom is None:
            return "domain is gone"
        last = ""
        for _ in range(60):  # the agent reconnects shortly after a revert
            now = time.time()
            try:
                dom.setTime({"seconds": int(now), "nseconds": int((now % 1) * 1e9)}, 0)
                return None
            except self._lv.libvirtError as e:
                last = e.get_error_message()
                time.sleep(0.05)
        return last

    async def reset(self, handle: DesktopHandle) -> DesktopHandle:
        box = self._boxes.get(handle.id)
        if box is not None and box.snapshot and self._qemu_running(box):
            t0 = time.monotonic()
            try:
                how = await asyncio.to_thread(self._revert, box.name)
            except (self._lv.libvirtError, ProviderError) as e:
                msg = e.get_error_message() if isinstance(e, self._lv.libvirtError) else str(e)
                log.warning("snapshot revert of %s failed (%s): booting a fresh VM", handle.id, msg)
            else:
                # libvirt may respawn qemu to revert (when it finds the running config and the
                # snapshot's not ABI-identical): track the current process.
                pid = await asyncio.to_thread(self._qemu_pid, box.name)
                respawned = pid != box.qemu_pid
                box.qemu_pid = pid
                why = await asyncio.to_thread(self._sync_clock, box.name)
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
        await asyncio.to_thread(self._destroy, name)
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


__all__ = ["LibvirtProvider", "domain_name", "kernel_cmdline", "netdev_arg", "qemu_ids", "read_metadata", "vm_plan"]
