"""A desktop VM's files on the host, and the account qemu opens them as.

On ``qemu:///system`` as root, qemu runs as the distribution's unprivileged qemu account
(``libvirt-qemu`` or ``qemu``) when that account can reach every file of the VM
(:func:`qemu_ids`); where the farm's state dir is private, the per-desktop files go under
``/var/lib/osfarm/libvirt`` instead (:func:`qemu_root_and_ids`), and failing that qemu runs as
root, with a warning. Per desktop: a qcow2 overlay on the read-only base disk, the console log,
and the fw_cfg files (token, box plan) qemu reads as it starts, each made qemu's
(:func:`qemu_file`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pwd
import shutil
from pathlib import Path

from osfarm.providers.base import ProviderError

# The libvirt provider's log: these are its warnings.
log = logging.getLogger("osfarm.providers.libvirt")

MIN_FREE_BYTES = 2 << 30  # an overlay grows with what a task writes, and a snapshot holds the RAM
QEMU_ACCOUNTS = ("libvirt-qemu", "qemu")  # Debian/Ubuntu, Fedora/RHEL
QEMU_RUN_ROOT = Path("/var/lib/osfarm/libvirt")  # per-desktop VM files when the state dir is not qemu's to reach


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


def qemu_root_and_ids(state_dir: Path, root: Path, disk: list[Path]) -> tuple[Path, int, int]:
    """(dir of the per-desktop VM files, uid, gid qemu runs as): ``root`` (in the state dir) when
    qemu's account reaches it and the ``disk`` files, else a dir of this state dir's under
    :data:`QEMU_RUN_ROOT` when that one is reachable; a warning when qemu must run as root."""
    uid, gid, note = qemu_ids([*disk, root])
    if note and os.geteuid() == 0 and uid == 0 and "cannot reach" in note:
        # The state dir is private (e.g. under /root or a 0700 temp dir): the VMs' own files
        # go where the qemu account can reach them, named after this state dir.
        alt = QEMU_RUN_ROOT / hashlib.sha256(str(state_dir).encode()).hexdigest()[:12]
        alt.mkdir(parents=True, exist_ok=True)
        for d in (QEMU_RUN_ROOT.parent, QEMU_RUN_ROOT, alt):
            d.chmod(0o711)
        alt_uid, alt_gid, alt_note = qemu_ids([*disk, alt])
        if not alt_note:
            root, uid, gid, note = alt, alt_uid, alt_gid, ""
    if note:
        log.warning("%s", note)
    return root, uid, gid


def check_free_space(root: Path) -> None:
    """Raise ProviderError when ``root`` has too little room for desktop overlays."""
    free = shutil.disk_usage(root).free
    if free < MIN_FREE_BYTES:
        raise ProviderError(
            f"only {free / 2**30:.1f} GiB free in {root}: desktop overlays need at least "
            f"{MIN_FREE_BYTES / 2**30:.0f} GiB; free some space or set OSFARM_STATE_DIR elsewhere"
        )


def qemu_file(path: Path, text: str | None, mode: int, uid: int, gid: int) -> None:
    """A file qemu opens: written here (``text``; None: it exists), then made qemu's (``uid``,
    ``gid``: :func:`qemu_ids`)."""
    if text is not None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    if os.geteuid() == 0:
        os.chown(path, uid, gid)
    os.chmod(path, mode)


async def fresh_overlay(qemu_img: str, base: Path, ddir: Path, uid: int, gid: int) -> None:
    """A new qcow2 overlay on the read-only ``base`` (old disk and log removed), and the console
    log, both qemu's (it may run as an unprivileged account, see :func:`qemu_ids`)."""
    ddir.mkdir(parents=True, exist_ok=True)
    ddir.chmod(0o711)
    for name in ("disk.qcow2", "console.log", "token", "plan.json"):
        (ddir / name).unlink(missing_ok=True)
    proc = await asyncio.create_subprocess_exec(
        qemu_img, "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2",
        str(ddir / "disk.qcow2"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise ProviderError(f"qemu-img create of the overlay in {ddir} failed: "
                            f"{out.decode(errors='replace').strip()}")
    qemu_file(ddir / "disk.qcow2", None, 0o600, uid, gid)
    qemu_file(ddir / "console.log", "", 0o600, uid, gid)
