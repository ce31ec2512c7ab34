"""Linux namespace and mount system calls (``unshare``, ``setns``, ``mount``, ``pivot_root``)
through ctypes, for the code that builds a box's namespaces: the sandbox's box init and the
agent world every provider makes (:mod:`osfarm.desktop.box.agent_world`). Python 3.11 has none of
them in ``os``. Standard library only.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
SYS_PIVOT_ROOT = 155  # x86_64
SYS_SETGROUPS = 116


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def setns(fd: int, nstype: int = 0) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str | None, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
           f"mount {source or fstype} on {target}")


def bind(source: str, target: str, *, readonly: bool = True, nosuid: bool = True, nodev: bool = True,
         noexec: bool = False, recursive: bool = False) -> None:
    """A bind mount with its own flags: a bind ignores them, so they are set by a remount."""
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    flags = (MS_RDONLY * readonly) | (MS_NOSUID * nosuid) | (MS_NODEV * nodev) | (MS_NOEXEC * noexec)
    if flags:
        mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def umount(target: str, detach: bool = True) -> None:
    _check(_libc.umount2(_b(target), MNT_DETACH if detach else 0), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(SYS_PIVOT_ROOT, _b(new_root), _b(put_old)), f"pivot_root {new_root}")


def set_parent_death_signal(sig: int) -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def set_dumpable(on: bool) -> None:
    _check(_libc.prctl(PR_SET_DUMPABLE, int(on), 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def clear_groups() -> None:
    """setgroups(0, NULL): no supplementary groups (os.setgroups([]) does the same, named here
    for the order in which credentials are dropped)."""
    os.setgroups([])


def loopback_up() -> None:
    """Bring up ``lo`` in this network namespace (a new one starts with it down)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, req)[:18])[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def write_id_maps(pid: int, uid_map: list[tuple[int, int, int]], gid_map: list[tuple[int, int, int]]) -> None:
    """Write ``pid``'s user namespace maps (inside, outside, count); needs CAP_SETUID and
    CAP_SETGID in the parent namespace for anything beyond one's own ids."""
    for name, rows in (("uid_map", uid_map), ("gid_map", gid_map)):
        text = "".join(f"{inside} {outside} {count}\n" for inside, outside, count in rows)
        fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
