"""The session launcher's process tree: becoming a child subreaper, finding every descendant,
killing them all on stop and reaping adopted orphans meanwhile.

Apps that double-fork (soffice, chromium) would reparent to init and outlive the session; as a
child subreaper the launcher adopts them instead, so "every descendant" really is every process
of the desktop. Linux only (``prctl`` and ``/proc``); standard library only (imported before the
server stack, see :mod:`osfarm.desktop.launch.launcher`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable

PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> bool:
    """Make orphaned descendants reparent to us instead of to init (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children_via_task_files(pid: int) -> list[int] | None:
    """Children of ``pid`` from /proc/<pid>/task/*/children (None if the kernel lacks them)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # thread exited meanwhile
            return None  # kernel built without CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue
    return out


def _ppid_map() -> dict[int, list[int]]:
    """parent -> children for every process, from /proc/*/stat (fallback path)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: fields start after the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def children(pid: int) -> list[int]:
    """The live children of ``pid`` (zombies included)."""
    kids = _children_via_task_files(pid)
    return _ppid_map().get(pid, []) if kids is None else kids


def descendants(root: int | None = None) -> list[int]:
    """Every live descendant pid of ``root`` (default: this process), parents first."""
    root = os.getpid() if root is None else root
    out: list[int] = []
    stack = [root]
    fallback: dict[int, list[int]] | None = None
    while stack:
        pid = stack.pop()
        kids = None if fallback is not None else _children_via_task_files(pid)
        if kids is None:
            if fallback is None:
                fallback = _ppid_map()  # one /proc scan for the whole walk
            kids = fallback.get(pid, [])
        for k in kids:
            if k not in out:
                out.append(k)
                stack.append(k)
    return out


def is_zombie(pid: int) -> bool:
    """True for a process that has exited (zombie or dead) or is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")


def reap_all() -> None:
    """Collect every exited child (used only while shutting down)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_tree(grace_s: float = 2.0) -> list[int]:
    """SIGTERM every descendant, wait up to ``grace_s``, SIGKILL the rest. Returns survivors."""
    _signal_all(descendants(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        reap_all()
        alive = [p for p in descendants() if not is_zombie(p)]
        if not alive:
            break
        # New processes may have been forked between the walk and the signal: TERM them too.
        _signal_all(alive, signal.SIGTERM)
        time.sleep(0.02)
    for _ in range(50):
        left = descendants()
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.01)
        reap_all()
    reap_all()
    return [p for p in descendants() if not is_zombie(p)]


class ZombieReaper:
    """Reaps orphans adopted through the subreaper bit.

    ``subprocess`` owns the children it created and reaps them itself; reaping those here would
    make their ``returncode`` wrong. Adopted orphans have no owner, so a zombie child that stays a
    zombie for ``min_age_s`` is collected here. Call :meth:`tick` periodically (one thread).
    """

    def __init__(self, min_age_s: float = 1.0, keep: set[int] | None = None):
        self.min_age_s = min_age_s
        self.keep = keep if keep is not None else set()
        self._seen: dict[int, float] = {}

    def tick(self) -> int:
        now = time.monotonic()
        zombies = {p for p in children(os.getpid()) if p not in self.keep and is_zombie(p)}
        reaped = 0
        for pid in list(self._seen):
            if pid not in zombies:
                del self._seen[pid]
        for pid in zombies:
            first = self._seen.setdefault(pid, now)
            if now - first >= self.min_age_s:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        reaped += 1
                except ChildProcessError:
                    pass
                self._seen.pop(pid, None)
        return reaped
