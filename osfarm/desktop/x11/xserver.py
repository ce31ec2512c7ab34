"""The desktop's X display: one Xvfb, its display number and the X lock files in ``/tmp``.

Xvfb is started with ``-displayfd``: it writes the display number to a pipe once it accepts
clients, so readiness is an event rather than a poll. Lock files left by dead X servers
(``/tmp/.X<n>-lock`` whose pid is gone or now belongs to something else) are removed before a
display is picked. Standard library only (imported before the server stack).
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import time
from pathlib import Path

from osfarm.errors import InfraError

log = logging.getLogger(__name__)

MAX_DISPLAY = 1000
START_ATTEMPTS = 20


class DisplayError(InfraError, RuntimeError):
    """Xvfb could not be started; the message says why."""


class _DisplayBusy(Exception):
    """Xvfb exited before becoming ready (usually: the display is taken)."""


def x_lock(n: int) -> Path:
    return Path(f"/tmp/.X{n}-lock")


def x_socket(n: int) -> Path:
    return Path(f"/tmp/.X11-unix/X{n}")


def lock_is_stale(lock: Path) -> bool:
    """True if the X lock's owner is gone (or the pid now belongs to something else)."""
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        return True  # unreadable / garbage lock
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # someone else's live process
    # Pids are reused quickly in small pid namespaces: a live pid that is not an X server
    # does not hold the display.
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return True
    return not (comm.startswith("X") or comm.startswith("Xvfb"))


def lock_owner(n: int) -> int | None:
    """The pid written in display ``n``'s lock file, if there is a readable one."""
    try:
        return int(x_lock(n).read_text().strip())
    except (OSError, ValueError):
        return None


def remove_display_files(n: int) -> None:
    """Delete display ``n``'s lock file and socket."""
    x_lock(n).unlink(missing_ok=True)
    try:
        x_socket(n).unlink()
    except OSError:
        pass


def clear_stale_x_lock(n: int) -> bool:
    """Remove /tmp/.X<n>-lock and its socket if the lock is stale. Returns True if removed."""
    lock = x_lock(n)
    if not lock.exists() or not lock_is_stale(lock):
        return False
    remove_display_files(n)
    return True


def clear_all_stale_x_locks() -> list[int]:
    """Remove every stale X lock in /tmp; returns their display numbers."""
    numbers = (lock.name[2:-5] for lock in Path("/tmp").glob(".X*-lock"))
    return [int(num) for num in numbers if num.isdigit() and clear_stale_x_lock(int(num))]


class Xvfb:
    """One Xvfb server: :meth:`start`, then :meth:`wait_ready` (which may retry in auto mode),
    then :meth:`release` after the process is gone."""

    def __init__(self, exe: str, width: int, height: int, depth: int):
        self.exe, self.width, self.height, self.depth = exe, width, height, depth
        self.proc: subprocess.Popen[bytes] | None = None
        self.number: int | None = None  # once ready
        self._wanted: int | None = None
        self._tried: set[int] = set()
        self._pipe = -1
        self._trying = -1

    @property
    def name(self) -> str:
        """The DISPLAY value (``":N"``) once ready."""
        return f":{self.number}" if self.number is not None else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, display: int | None) -> None:
        """Launch Xvfb on display ``display``, or (None) on the first display that looks free."""
        self._wanted = display
        if display is None:
            clear_all_stale_x_locks()
            self._launch(self._next_free())
        else:
            if clear_stale_x_lock(display):
                log.warning("removed stale X lock for :%d", display)
            self._launch(display)

    def _next_free(self) -> int:
        # Xvfb's own -displayfd scan only checks that it can bind the socket; in a /tmp shared
        # with other X servers (other namespaces, -nolisten local) that is not enough, so skip
        # displays with a lock or socket file too.
        for n in range(MAX_DISPLAY):
            if n in self._tried or x_lock(n).exists() or x_socket(n).exists():
                continue
            return n
        raise DisplayError(f"no free X display number below {MAX_DISPLAY}")

    def _launch(self, num: int) -> None:
        rfd, wfd = os.pipe()
        cmd = [
            self.exe, f":{num}", "-displayfd", str(wfd),
            "-screen", "0", f"{self.width}x{self.height}x{self.depth}",
            # No abstract socket: it lives in the network namespace, so boxes sharing the host's
            # network would reach each other's displays; the socket file in the box's /tmp is all.
            "-nolisten", "tcp", "-nolisten", "local", "-noreset", "-dpi", "96",
            "+extension", "RANDR",
        ]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(wfd,), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL)
        except FileNotFoundError:
            os.close(rfd)
            os.close(wfd)
            raise DisplayError(f"{self.exe}: not found; install the xvfb package") from None
        os.close(wfd)
        self._pipe = rfd
        self._trying = num

    def wait_ready(self, timeout: float = 15.0) -> int:
        """Block until Xvfb writes its display number (it accepts clients from then on), claim
        the display's lock file, and return the number.

        In auto mode a display taken meanwhile (Xvfb exits at once) is retried on the next one.
        """
        for _attempt in range(START_ATTEMPTS):
            try:
                self.number = self._wait_once(timeout)
            except _DisplayBusy:
                if self._wanted is not None:
                    raise DisplayError(f"Xvfb could not start on :{self._wanted} (display in use?)") from None
                self._tried.add(self._trying)
                self._launch(self._next_free())
                continue
            self._claim_lock()
            return self.number
        raise DisplayError(f"Xvfb failed to start on {START_ATTEMPTS} displays in a row")

    def _wait_once(self, timeout: float) -> int:
        assert self.proc is not None
        rfd = self._pipe
        buf = b""
        deadline = time.monotonic() + timeout
        try:
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DisplayError(f"Xvfb did not become ready within {timeout:g}s")
                ready, _, _ = select.select([rfd], [], [], min(left, 0.5))
                if ready:
                    chunk = os.read(rfd, 64)
                    if not chunk:
                        self.proc.wait()
                        raise _DisplayBusy()
                    buf += chunk
                elif self.proc.poll() is not None:
                    raise _DisplayBusy()
        finally:
            os.close(rfd)
        return int(buf.strip())

    def _claim_lock(self) -> None:
        """Claim /tmp/.X<n>-lock for our Xvfb.

        With -displayfd Xvfb neither checks nor writes lock files; writing one keeps X servers
        started the classic way (``Xvfb :N``, xvfb-run) from picking our display.
        """
        assert self.number is not None and self.proc is not None
        lock = x_lock(self.number)
        if lock.exists() and lock_is_stale(lock):
            lock.unlink(missing_ok=True)  # not the socket: our Xvfb just created it
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        except OSError:
            return  # held by a live X server for another screen of ours, or /tmp read-only
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.proc.pid:>10}\n")

    def release(self) -> None:
        """Remove the display's lock and socket if the lock is ours (call once Xvfb is dead)."""
        if self.number is not None and self.proc is not None and lock_owner(self.number) == self.proc.pid:
            remove_display_files(self.number)
