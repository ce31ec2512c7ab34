"""What every provider does with its boxes, written once: name checks, the wait for a new box's
guest server, discarding a half-started box, reaping what an earlier farm left, and the host
resources boxes share (the farm lock, loopback ports, X display numbers)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from osfarm.providers.base import DesktopHandle, ProviderError

SOCKET_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
HEALTH_POLL_S = 0.025


def check_desktop_id(desktop_id: str) -> None:
    """Desktop ids become file, container and domain names: short and plain."""
    if not desktop_id or len(desktop_id) > 12 or not all(c.isalnum() or c in "-_" for c in desktop_id):
        raise ProviderError(f"bad desktop id {desktop_id!r}: use 1-12 letters, digits, '-' or '_'")


# -- starting a box ---------------------------------------------------------------------------------


async def wait_guest_ready(
    handle: DesktopHandle,
    deadline: float,
    timeout_s: float,
    *,
    box_gone: Callable[[], Awaitable[str | None]],
    box_log: Callable[[], Awaitable[str]],
    check_box_every_s: float = 0.0,
    poll_s: float = HEALTH_POLL_S,
    claim: SocketClaim | None = None,
) -> None:
    """Return once the box's guest server answers ``GET /v1/health`` with 200.

    ``box_gone()`` says what happened when the box itself died (None while it runs); it is
    asked at most every ``check_box_every_s``, as it may cost a daemon call. ``box_log()`` is
    the tail of the box's log, for the error. A unix-socket guest is only asked once its
    socket file exists. Raises ProviderError at ``deadline`` (``time.monotonic()``) or when the
    box dies first, naming the last answer and the log.

    With ``claim``, the guest's socket is first moved out of the box-writable run dir to the
    endpoint's path (:func:`claim_guest_socket`), and only that path is ever connected to.
    """
    last = "guest not answering yet"
    next_check = 0.0
    sock = handle.endpoint.uds
    async with handle.endpoint.client(timeout=2.0) as client:
        while True:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + check_box_every_s
                gone = await box_gone()
                if gone is not None:
                    raise ProviderError(f"desktop {handle.id}: {gone} before it was ready; {await box_log()}")
            if now > deadline:
                raise ProviderError(f"desktop {handle.id} not ready after {timeout_s:g}s (last: {last}); "
                                    f"{await box_log()}")
            if claim is not None and not os.path.lexists(claim.dest):
                if not claim_guest_socket(claim):
                    last = "guest socket not created yet"
                    await asyncio.sleep(poll_s)
                    continue
            if sock is None or os.path.exists(sock):
                try:
                    r = await client.get("/v1/health")
                    if r.status_code == 200:
                        return
                    last = f"GET /v1/health -> {r.status_code} {r.text[:200]}"
                except httpx.TransportError as e:
                    last = f"GET /v1/health failed: {e!r}"
            else:
                last = "guest socket not created yet"
            await asyncio.sleep(poll_s)


@contextlib.asynccontextmanager
async def discarded_on_failure(desktop_id: str, discard: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Never leave a half-started box behind: on any failure in the block (cancellation
    included) ``discard()`` it; an unexpected error becomes a ProviderError naming the desktop."""
    try:
        yield
    except BaseException as e:
        await discard()
        if isinstance(e, ProviderError) or not isinstance(e, Exception):
            raise
        raise ProviderError(f"desktop {desktop_id} failed to start: {e!r}") from e


def log_tail(path: str, lines: int = 30, what: str = "log") -> str:
    """The last ``lines`` lines of a box's log (read from its last 8 KiB), for error messages.
    Never through a symlink, never blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return f"(no {what}: not a file)"
        with os.fdopen(fd, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return f"(no {what})"
    return "\n".join(text.splitlines()[-lines:]) or f"(empty {what})"


# -- paths a box can write ------------------------------------------------------------------------


@dataclass(frozen=True)
class SocketClaim:
    """Where the guest makes its socket (``source``, in the box's run dir) and where the farm
    takes it (``dest``, a dir no box can write), with the uid that must own it."""

    source: Path
    dest: Path
    owner_uid: int | None
    ready: Path | None = None  # claim only once this exists (the guest's state file: it is listening)


def claim_guest_socket(claim: SocketClaim) -> bool:
    """Move the guest's socket from the run dir (which the box can write) to ``dest`` (which it
    cannot) by rename, which moves the directory entry itself and follows nothing; then check
    what was moved. Returns False while there is no socket yet; raises ProviderError when the
    entry is not a socket, or not the guest's: a symlink to another socket (the Docker daemon's)
    would otherwise hand that socket to every caller of the guest's routes.

    Once moved, the path cannot change under the farm, so every later connect is to the
    guest's own listening socket."""
    if claim.ready is not None and not os.path.lexists(claim.ready):
        return False  # the server may still be setting its socket up (uvicorn chmods it)
    try:
        os.rename(claim.source, claim.dest)
    except FileNotFoundError:
        return False
    st = os.lstat(claim.dest)
    owner_ok = claim.owner_uid is None or st.st_uid == claim.owner_uid
    if not stat.S_ISSOCK(st.st_mode) or not owner_ok:
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a socket" if not stat.S_ISSOCK(st.st_mode) \
            else f"owned by uid {st.st_uid}, not the guest's {claim.owner_uid}"
        with contextlib.suppress(OSError):
            os.unlink(claim.dest)
        raise ProviderError(f"the box's guest socket {claim.source} is {what}: refused (the farm never "
                            "follows a path the box can write)")
    return True


def read_box_file(path: Path, owner_uid: int | None, limit: int = 1 << 20) -> bytes:
    """A small file the box wrote (e.g. its state file): a regular file owned by ``owner_uid``,
    opened without following a symlink, at most ``limit`` bytes. Raises OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or (owner_uid is not None and st.st_uid != owner_uid):
            raise OSError(f"{path}: not a regular file of uid {owner_uid}")
        return f.read(limit)


def password_hash(password: str) -> str:
    """The agent's password (OSWorld's "password") for its /etc/shadow: a SHA-512 crypt(3) hash, as
    /etc/shadow holds it (by openssl: Python's crypt module is deprecated and gone in 3.13)."""
    try:
        out = subprocess.run(["openssl", "passwd", "-6", "-stdin"], input=password, capture_output=True,
                             text=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as e:
        raise ProviderError(f"cannot hash the agent's password with openssl ({e}): apt-get install openssl") from None
    return out.stdout.strip()


# -- reaping ----------------------------------------------------------------------------------------


async def remove_stale_dirs(root: Path, live: Iterable[str]) -> int:
    """Delete every directory under ``root`` not named in ``live`` (boxes of an earlier farm);
    returns how many."""
    keep = set(live)
    stale = [d for d in (root.iterdir() if root.exists() else ()) if d.is_dir() and d.name not in keep]
    for d in stale:
        await asyncio.to_thread(shutil.rmtree, d, True)
    return len(stale)


def pid_gone(pid: int) -> bool:
    """The process exited (a zombie counts: only its parent's wait is left)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


async def wait_pids_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until every pid has exited; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if not pid_gone(p)]
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        left = [p for p in left if not pid_gone(p)]
    return left


# -- host resources ---------------------------------------------------------------------------------


def take_farm_lock(path: Path, what: str, fix: str, owner: str = "") -> int:
    """Hold an exclusive lock on ``path`` for this process's life (returns its fd).

    One farm per state/shared dir: a second farm's ``reap_orphans`` would otherwise remove the
    first one's boxes. ``what`` names the dir in the error, ``fix`` says how to get around it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ProviderError(f"another osfarm process is using {what} (lock {path} is held); {fix}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {owner}".rstrip().encode() + b"\n")
    return fd


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the caller binds it soon, or retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def abstract_x_displays() -> list[int]:
    """Display numbers whose abstract X socket is bound in this network namespace."""
    out = []
    try:
        with open("/proc/net/unix") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if path.startswith("@/tmp/.X11-unix/X") and path[17:].isdigit():
                    out.append(int(path[17:]))
    except OSError:
        pass
    return out
