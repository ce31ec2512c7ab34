"""Warm reset and the desktop's fingerprint, guest side (``/v1/session/*`` routes).

A **fingerprint** says what state a desktop is in, in the terms a task or an agent could notice:
the processes by command line (guest's and agent's), the writable trees (``/home/user``,
``/tmp``, ``/var/tmp``, ``/dev/shm``, the POSIX message queues in ``/dev/mqueue``, the agent's
``/run``; names, types, modes, owners, sizes, content hashes) and what else is in ``/home``, the
agent's ``/etc`` and mount table, the X server's state (screen size, root window properties,
selection owners, pressed keys and buttons, pointer, keyboard mapping, top-level windows, the
active one, the settings ``xmodmap``/``xset``/``xhost`` change, clients whose resources outlived
them) and the guest's own scratch dir.
Random names (temp dirs, window ids, bus addresses) are normalised, so two cold starts give the
same fingerprint; ``digest`` is its hash.

A **warm reset** gives a used desktop back the state it had once its cold start was ready, without
restarting Xvfb, the window manager, the panel or the guest: :func:`take_baseline` (right after
the cold start, once its panel and accessibility registry run) records what to go back to;
:func:`warm_reset` kills *every* process of the agent (SIGKILL, in rounds, until none is left:
double-forked daemons are still in the box's PID namespace, a process ignoring SIGTERM gets no
choice; the agent's D-Bus and AT-SPI buses too, since a task could have tampered with them), puts
the home back from the baseline's copy and removes what was added to the other writable trees (as
the agent's root, in the agent's namespaces), puts the X state back (keys and buttons released,
pointer, selections, windows and resources of dead clients, root properties, focus, button and
modifier mappings, keyboard/pointer controls, screen saver, font path, access control), starts the agent's buses
again and returns the new fingerprint's digest (the whole fingerprint where it differs from the
baseline's); the route then re-arms the guest with a new token and, once it has answered, starts
the guest's interpreter again. The farm compares the digest to the baseline's and restarts the
box cold where they differ.

What a warm reset cannot undo is refused (:class:`WarmResetError`, the farm then restarts cold):
a changed screen size, a wallpaper set, an agent process that survives the kill rounds; what it
does not undo shows in the fingerprint (the agent's own mounts, its /etc layer) and makes the
farm restart cold.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from Xlib import X, Xatom
from Xlib import display as xdisplay
from Xlib import error as xerror
from Xlib.ext import res, xtest

from osfarm.desktop.process_tree import children

if TYPE_CHECKING:
    from osfarm.desktop.guest_state import Desktop

WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run")
KILL_ROUNDS = 50
KILL_WAIT_S = 2.0  # for the killed processes to exit, all rounds together
HELPER_TIMEOUT_S = 20.0
# Root window properties the window manager keeps up to date itself.
WM_MANAGED = frozenset({"_NET_CLIENT_LIST", "_NET_CLIENT_LIST_STACKING", "_NET_ACTIVE_WINDOW"})
SELECTIONS = ("PRIMARY", "SECONDARY", "CLIPBOARD", "WM_S0", "_NET_SYSTEM_TRAY_S0")
_RANDOM = [
    (re.compile(r"osfarm-(a11y|guest|run|code)-[A-Za-z0-9_]+"), r"osfarm-\1-*"),
    (re.compile(r"dbus-[A-Za-z0-9]{6,}"), "dbus-*"),
    (re.compile(r"guid=[0-9a-f]+"), "guid=*"),
    (re.compile(r"/proc/\d+/fd/\d+"), "/proc/*/fd/*"),
    (re.compile(r"bus_\d+"), "bus_*"),
    (re.compile(r"--print-address[= ]\d+"), "--print-address=*"),  # a pipe's fd number
]


class WarmResetError(RuntimeError):
    """The desktop cannot be put back warm; the farm restarts it cold. The message says why."""


def normalise(text: str) -> str:
    for pattern, repl in _RANDOM:
        text = pattern.sub(repl, text)
    return text


# -- the agent's side: one helper run as the agent's root in its namespaces --------------------------

# Standard library only: it runs with the box's python3, in the agent's world.
_HELPER = r'''
import os, stat, sys
# Only os, stat and sys at the start: a warm reset waits for the restore, not for imports (json,
# hashlib, tarfile, shutil each cost milliseconds); the rest is imported where it is needed.
mode, home = sys.argv[1], sys.argv[2]
WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run")

def sha256():
    try:
        from _sha256 import sha256 as h
    except ImportError:
        try:
            from _sha2 import sha256 as h
        except ImportError:
            from hashlib import sha256 as h
    return h

def sha(p, new):
    h = new()
    try:
        with open(p, "rb", buffering=0) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        return "unreadable:%s" % e.errno
    return h.hexdigest()[:24]

def entry(p, rel, st, content, new):
    e = [rel, stat.S_IFMT(st.st_mode) >> 12, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]
    if stat.S_ISREG(st.st_mode):
        e.append(st.st_size)
        if content(st):
            e.append(sha(p, new))
    elif stat.S_ISLNK(st.st_mode):
        e.append(os.readlink(p))
    return e

def walk(root, content=lambda st: True):
    # the root itself (".": its mode and owner), then everything under it (no symlink followed),
    # each named by its path relative to the root
    new = sha256()
    try:
        out = [entry(root, ".", os.lstat(root), lambda st: False, new)]
    except OSError:
        return []
    todo = [(root, "")]
    while todo:
        d, prefix = todo.pop()
        try:
            with os.scandir(d) as it:
                names = sorted(e.name for e in it)
        except OSError:
            continue
        for name in names:
            p = d + "/" + name if d != "/" else "/" + name
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out.append(entry(p, prefix + name, st, content, new))
            if stat.S_ISDIR(st.st_mode):
                todo.append((p, prefix + name + "/"))
    return out

def mounts():
    out = []
    for line in open("/proc/self/mountinfo"):
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        out.append([f[4], f[5], r[0], r[2] if len(r) > 2 else ""])
    return sorted(out)

def scan_fixed():
    # what the agent's buses do not write: the home, the agent's /etc, the mounts, /home
    try:
        agent_dev = os.lstat("/etc/passwd").st_dev
    except OSError:
        agent_dev = -1
    etc = walk("/etc", content=lambda st: st.st_dev == agent_dev)
    top = os.path.dirname(home)
    return {"home": walk(home), "etc": etc, "mounts": mounts(),
            "homes": sorted(os.listdir(top)) if os.path.isdir(top) else []}

def scan_writable():
    return {t: walk(t) for t in WRITABLE if os.path.isdir(t)}

def dump(obj):
    import json
    return json.dumps(obj)

def remove(p):
    try:
        if os.path.isdir(p) and not os.path.islink(p):
            import shutil
            shutil.rmtree(p)
        else:
            os.unlink(p)
    except OSError:
        pass

# The home's archive: per entry (parents first) a header line "type mode uid gid mtime_ns
# path_len data_len", the path (relative to the home) and the data (a file's content, a link's
# target). Directories, regular files, symlinks and FIFOs; sockets and devices are left out.
KINDS = {stat.S_IFDIR: 0, stat.S_IFREG: 1, stat.S_IFLNK: 2, stat.S_IFIFO: 3}

def snapshot():
    out = sys.stdout.buffer
    todo = [(home, b"")]
    while todo:
        d, prefix = todo.pop(0)
        for name in sorted(os.listdir(os.fsencode(d))):
            p = os.path.join(d, os.fsdecode(name))
            st = os.lstat(p)
            kind = KINDS.get(stat.S_IFMT(st.st_mode))
            if kind is None:
                continue
            data = b""
            if kind == 1:
                with open(p, "rb") as f:
                    data = f.read()
            elif kind == 2:
                data = os.fsencode(os.readlink(p))
            rel = prefix + name
            out.write(b"%d %d %d %d %d %d %d\n" % (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                                                    st.st_mtime_ns, len(rel), len(data)))
            out.write(rel)
            out.write(data)
            if kind == 0:
                todo.append((p, rel + b"/"))

def unpack(data):
    dirs = []
    i, n, base = 0, len(data), os.fsencode(home) + b"/"
    while i < n:
        j = data.index(b"\n", i)
        kind, mode, uid, gid, mtime, plen, dlen = (int(x) for x in data[i:j].split())
        rel = data[j + 1:j + 1 + plen]
        body = data[j + 1 + plen:j + 1 + plen + dlen]
        i = j + 1 + plen + dlen
        if rel.startswith(b"/") or b".." in rel.split(b"/"):
            sys.exit("bad path in the home archive")
        p = base + rel
        if kind == 0:
            os.mkdir(p, 0o700)
            dirs.append((p, mode, uid, gid, mtime))
            continue
        if kind == 1:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        elif kind == 2:
            os.symlink(body, p)
            os.lchown(p, uid, gid)
        else:
            os.mkfifo(p, 0o600)
            os.chown(p, uid, gid, follow_symlinks=False)
            os.chmod(p, mode, follow_symlinks=False)
        os.utime(p, ns=(mtime, mtime), follow_symlinks=False)
    for p, mode, uid, gid, mtime in reversed(dirs):  # children first: their creation changes the mtime
        os.chown(p, uid, gid, follow_symlinks=False)
        os.chmod(p, mode, follow_symlinks=False)
        os.utime(p, ns=(mtime, mtime), follow_symlinks=False)

def restore(keep, emptied, data):
    # keep: the paths the writable trees held at the baseline; emptied: dirs the guest removes next
    for d in emptied:  # empty what is the agent's in them
        for dirpath, dirs, files in os.walk(d):
            for name in dirs + files:
                remove(os.path.join(dirpath, name))
    for name in os.listdir(home):
        remove(os.path.join(home, name))
    unpack(data)
    parent = os.path.dirname(home)
    for name in os.listdir(parent):
        if name != os.path.basename(home):
            remove(os.path.join(parent, name))
    # Every agent process is gone: a socket left is stale (the guest's are not the agent's to remove).
    for top in WRITABLE:
        for dirpath, dirs, files in os.walk(top, topdown=True):
            for name in list(dirs) + files:
                p = os.path.join(dirpath, name)
                try:
                    sock = stat.S_ISSOCK(os.lstat(p).st_mode)
                except OSError:
                    continue
                if sock or p not in keep:
                    remove(p)
                    if name in dirs:
                        dirs.remove(name)
    # What is kept gets the time of now: a timestamp the agent set (touch -d) would carry a message
    # to the next episode's agent.
    for p in keep:
        try:
            os.utime(p, follow_symlinks=False)
        except OSError:
            pass

def paths(blob):
    return [os.fsdecode(x) for x in blob.split(b"\0") if x]

out = sys.stdout
if mode == "scan":
    out.write(dump({**scan_fixed(), **scan_writable()}))
elif mode == "snapshot":
    snapshot()
elif mode == "reset":
    # One process for a warm reset's file work (it runs once every agent process is gone).
    # stdin: "len_keep len_emptied len_archive", then the NUL-separated paths to keep (in the
    # writable trees), the dirs to empty, the home's archive. Out: "restored" once the files are
    # back; the scan of what the buses do not write, on a line; then, once the guest has started
    # the buses and sent "scan", the writable trees.
    inp = sys.stdin.buffer
    sizes = [int(x) for x in inp.readline().split()]
    blobs = [inp.read(k) for k in sizes]
    if len(sizes) != 3 or [len(b) for b in blobs] != sizes:
        sys.exit("short input")
    restore(set(paths(blobs[0])), paths(blobs[1]), blobs[2])
    out.write("restored\n")
    out.flush()
    out.write(dump(scan_fixed()) + "\n")
    out.flush()
    if inp.readline().strip() != b"scan":
        sys.exit("no scan request")
    out.write(dump(scan_writable()))
'''


def _agent_root_argv(desk: Desktop, *args: str) -> list[str]:
    """The helper as the agent's root in the agent's namespaces (a plain desktop: this process)."""
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
    argv = [py, "-I", "-S", "-c", _HELPER, *args]  # no site (sitecustomize lives in the agent's /etc)
    world = desk.agent
    if world is None:
        return argv
    return [world.nsenter, f"--user=/proc/{world.holder_pid}/fd/{world.userns_fd}",
            f"--mount=/proc/{world.holder_pid}/fd/{world.mntns_fd}", "--setuid=0", "--setgid=0", "--wd=/", "--",
            *argv]


def _helper(desk: Desktop, *args: str, stdin: bytes = b"") -> bytes:
    proc = subprocess.run(_agent_root_argv(desk, *args), input=stdin, capture_output=True,
                          timeout=HELPER_TIMEOUT_S, check=False, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    if proc.returncode != 0:
        raise WarmResetError(f"agent-side helper {args[0]} failed ({proc.returncode}): "
                             f"{proc.stderr.decode(errors='replace')[-500:]}")
    return proc.stdout


class _HelperSession:
    """The helper in ``reset`` mode: one process, spoken to in steps (see the helper), each read
    bounded by the helper's deadline; killed on any failure."""

    def __init__(self, desk: Desktop, *args: str) -> None:
        self.proc = subprocess.Popen(_agent_root_argv(desk, *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        self.deadline = time.monotonic() + HELPER_TIMEOUT_S
        self._buf = b""
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None

    def send(self, data: bytes) -> None:
        """Write in the background (a pipe blocks past its buffer until the helper reads)."""
        def go() -> None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except BaseException as e:  # noqa: BLE001 - reported by the next read
                self._write_error = e

        if self._writer is not None:
            self._writer.join(max(0.0, self.deadline - time.monotonic()))
        self._writer = threading.Thread(target=go, daemon=True, name="warm-helper-stdin")
        self._writer.start()

    def _read(self, until_eof: bool) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            if not until_eof and b"\n" in self._buf:
                line, _, self._buf = self._buf.partition(b"\n")
                return line
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise WarmResetError(f"agent-side helper did not answer within {HELPER_TIMEOUT_S:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                if until_eof:
                    out, self._buf = self._buf, b""
                    return out
                self._failed("ended early")
            self._buf += chunk

    def line(self) -> bytes:
        return self._read(until_eof=False)

    def finish(self) -> bytes:
        """The rest of its output, once it exited successfully."""
        out = self._read(until_eof=True)
        try:
            self.proc.wait(max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._failed("did not exit")
        if self.proc.returncode != 0:
            self._failed(f"failed ({self.proc.returncode})")
        return out

    def _failed(self, what: str) -> None:
        self.kill()
        err = self.proc.stderr.read() if self.proc.stderr is not None else b""
        extra = f"; writing to it: {self._write_error}" if self._write_error else ""
        raise WarmResetError(f"agent-side helper {what}: {err.decode(errors='replace')[-500:]}{extra}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)

    def close(self) -> None:
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


# The guest interpreter's scratch dir in /tmp: made anew with each interpreter (a warm reset
# restarts it in the background); what the agent writes into it is still counted.
_SCRATCH = re.compile(r"osfarm-code-\*$")


def _files(scan: dict[str, list[list[Any]]]) -> dict[str, list[list[Any]]]:
    out = {}
    for k, v in scan.items():
        rows = [[normalise(x) if isinstance(x, str) else x for x in e] for e in v]
        rows = [e for e in rows if not (_SCRATCH.match(e[0]) or e[0].startswith("osfarm-code-*/"))]
        out[k] = sorted(rows, key=json.dumps) if k != "homes" else rows
    return out


# -- processes ------------------------------------------------------------------------------------


def _proc_table(cmdline: bool = True) -> dict[int, tuple[int, str, float]]:
    """pid -> (uid, command line, start ticks) of every process this guest can see (the box's);
    without ``cmdline``, "" for each command line. Zombies are left out, but not a process whose
    main thread exited while its other threads run (its stat says Z: it would escape the kill)."""
    out: dict[int, tuple[int, str, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/status") as f:
                status = {k: v.split() for k, _, v in (ln.partition(":") for ln in f)}
            uid = int(status["Uid"][0])
            cmd = ""
            if cmdline:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat", "rb") as f:
                head, _, tail = f.read().rpartition(b")")
                fields = tail.split()
            if fields[0] == b"Z":
                # a zombie, unless only its main thread exited (pthread_exit) and others run on:
                # then it is a live process with no command line, named by its comm
                if int(status.get("Threads", ["1"])[0]) <= 1:
                    continue
                cmd = cmd or "[" + head.partition(b"(")[2].decode(errors="replace") + "]" if cmdline else ""
            out[pid] = (uid, cmd, float(fields[19]))
        except (OSError, StopIteration, IndexError, ValueError, KeyError):
            continue
    return out


def _is_agent(uid: int, guest_uid: int) -> bool:
    """A process of the agent: neither the guest's nor the box's root (a Docker box's init, tini,
    is PID 1 as root; the agent's root is mapped to a non-zero uid, AgentWorldSpec.outside_base)."""
    return uid not in (guest_uid, 0)


def _agent_world_view() -> dict[str, Any]:
    """What the helper runs on, seen by the guest from the kernel rather than reported by the
    helper: the agent's mount table (a bind mount over python3 or /usr would show here) and the
    dynamic loader's files in the agent's /etc (ld.so.preload, ld.so.cache could inject code into
    anything run there). An agent that forged the helper's report changes one of these, and the
    fingerprint differs from the cold start's."""
    guest_uid = os.getuid()
    agents = sorted(pid for pid, (uid, _, _) in _proc_table().items() if _is_agent(uid, guest_uid))
    for pid in agents:
        try:
            with open(f"/proc/{pid}/mountinfo") as f:
                rows = []
                for line in f:
                    left, _, right = line.partition(" - ")
                    a, b = left.split(), right.split()
                    rows.append(" ".join([a[4], a[5], b[0], normalise(b[2]) if len(b) > 2 else ""]))
            root = f"/proc/{pid}/root/etc"
            loader = {}
            for name in ("ld.so.preload", "ld.so.cache"):
                try:
                    fd = os.open(f"{root}/{name}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except FileNotFoundError:
                    loader[name] = None
                    continue
                except OSError as e:
                    loader[name] = f"unreadable:{e.errno}"
                    continue
                with os.fdopen(fd, "rb") as fh:
                    loader[name] = hashlib.sha256(fh.read(64 << 20)).hexdigest()[:24]
            return {"mounts": sorted(rows), "loader": loader}
        except OSError:
            continue  # it went away: the next one
    return {"mounts": None, "loader": None}


def _sysv_ipc() -> dict[str, list[str]]:
    """The box's System V shared memory, semaphores and message queues (they outlive the process
    that made them): perms and size/count and owner, per object."""
    out: dict[str, list[str]] = {}
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        head = lines[0].split() if lines else []
        keep = [i for i, h in enumerate(head) if h in ("perms", "size", "nsems", "cbytes", "qnum", "uid")]
        out[kind] = sorted(" ".join(ln.split()[i] for i in keep) for ln in lines[1:] if ln.strip())
    return out


def _processes(desk: Desktop) -> list[str]:
    me, guest_uid, runner = os.getpid(), os.getuid(), desk.runner_pid()
    rows = []
    for pid, (uid, cmd, _) in _proc_table().items():
        if pid in (me, runner) or not cmd or "/osfarm_kernel.py" in cmd:  # the interpreter: restarted apart
            continue
        who = "guest" if uid == guest_uid else "agent" if _is_agent(uid, guest_uid) else "box"
        rows.append(f"{who} {normalise(cmd)}")
    return sorted(rows)


def _agent_pids(baseline: set[tuple[int, float]] | None = None) -> list[int]:
    """The agent's processes (not the guest's uid) that are not in ``baseline`` ((pid, start))."""
    guest_uid = os.getuid()
    return [pid for pid, (uid, _, start) in _proc_table(cmdline=False).items()
            if _is_agent(uid, guest_uid) and (baseline is None or (pid, start) not in baseline)]


def _reap_agent_zombies() -> int:
    """Collect the killed agent processes this guest adopted (it is the box's child subreaper)
    now, not a second later: a zombie keeps its name (``prctl(PR_SET_NAME)``: 15 bytes the agent
    chose) in ``/proc`` for the next episode's agent to read. Returns how many."""
    guest_uid, reaped = os.getuid(), 0
    for pid in children(os.getpid()):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = {k: v.split() for k, _, v in (ln.partition(":") for ln in f)}
            if status["State"][0] not in ("Z", "X") or not _is_agent(int(status["Uid"][0]), guest_uid):
                continue
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped += 1
        except (OSError, KeyError, IndexError, ValueError, ChildProcessError):
            continue
    return reaped


def kill_agent_processes(baseline: set[tuple[int, float]]) -> int:
    """SIGKILL every agent process that is not in ``baseline``, in rounds until none is left (a
    process that forks meanwhile is caught in the next round). Returns how many were killed.

    Each round waits for its victims to have exited (their pidfds turn readable), not a fixed
    time; a pidfd also makes sure the signal goes to the process seen, not to one that got its
    pid since."""
    killed: set[int] = set()
    deadline = time.monotonic() + KILL_WAIT_S
    for _ in range(KILL_ROUNDS):
        victims = _agent_pids(baseline)
        if not victims:
            return len(killed)
        poller = select.poll()
        fds = []
        try:
            for pid in victims:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # gone already (or pidfds unsupported: a plain kill, then a short wait)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                    fds.append(-1)
                    continue
                fds.append(fd)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed.add(pid)
                poller.register(fd, select.POLLIN)
            waiting = {fd for fd in fds if fd >= 0}
            if -1 in fds:
                time.sleep(0.005)
            while waiting and time.monotonic() < deadline:
                for fd, _ in poller.poll(max(1, int(min(0.25, deadline - time.monotonic()) * 1000))):
                    poller.unregister(fd)
                    waiting.discard(fd)
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        if time.monotonic() >= deadline:
            break
    left = _agent_pids(baseline)
    if not left:
        return len(killed)
    raise WarmResetError(f"agent processes survived {KILL_ROUNDS} kill rounds: {left[:10]}")


# -- X --------------------------------------------------------------------------------------------


# Atom names by (display, atom): an atom keeps its name for the X server's life, which in a box is
# the guest's (cleared when a baseline is taken). Saves a round trip per property and type.
_atom_names: dict[tuple[str, int], str] = {}


def _atom_name(d: Any, atom: int) -> str:
    key = (d.get_display_name(), atom)
    name = _atom_names.get(key)
    if name is None:
        name = _atom_names[key] = d.get_atom_name(atom)
    return name


@contextlib.contextmanager
def _x_connection(display: str, d: Any = None) -> Any:
    """``d`` where the caller has a connection open, else a new one, closed afterwards."""
    if d is not None:
        yield d
        return
    d = xdisplay.Display(display)
    try:
        yield d
    finally:
        d.close()


def _x_state(display: str, conn: Any = None) -> dict[str, Any]:
    with _x_connection(display, conn) as d:
        root = d.screen().root
        s = d.screen()
        props: dict[str, Any] = {}
        for atom in root.list_properties():
            name = _atom_name(d, atom)
            p = root.get_full_property(atom, X.AnyPropertyType)
            if p is None:
                continue
            tname = _atom_name(d, p.property_type) if p.property_type else ""
            value: Any
            if name in WM_MANAGED or p.property_type in (Xatom.WINDOW, Xatom.PIXMAP):
                value = sum(1 for v in p.value if v)
                if name in WM_MANAGED and not value:
                    continue  # no active window, an empty list, or none at all: the same to a task
                if name == "_NET_ACTIVE_WINDOW":
                    try:
                        w = d.create_resource_object("window", p.value[0])
                        g = w.get_geometry()
                        value = [list(w.get_wm_class() or []), normalise(str(w.get_wm_name() or "")), g.width, g.height]
                    except Exception:  # noqa: BLE001 - a window that is gone: no active window
                        continue
            elif p.format == 8:
                raw = p.value if isinstance(p.value, bytes) else str(p.value).encode()
                value = normalise(raw.decode(errors="replace"))
            elif p.property_type == Xatom.ATOM:
                value = sorted(_atom_name(d, v) for v in p.value)
            else:
                value = list(p.value)
            props[name] = [tname, p.format, value]
        selections = {}
        for sel in SELECTIONS:
            selections[sel] = bool(d.get_selection_owner(d.intern_atom(sel)))
        ptr = root.query_pointer()
        keymap = d.query_keymap()
        pressed = [i * 8 + b for i, byte in enumerate(keymap) for b in range(8) if byte & (1 << b)]
        first, last = d.display.info.min_keycode, d.display.info.max_keycode
        keysyms = [list(k) for k in d.get_keyboard_mapping(first, last - first + 1)]
        mapping = hashlib.sha256(json.dumps(keysyms).encode()).hexdigest()[:24]
        windows = []
        for w in root.query_tree().children:
            try:
                attrs = w.get_attributes()
                geo = w.get_geometry()
                cls = w.get_wm_class()
                windows.append([attrs.map_state, list(cls) if cls else [], geo.width, geo.height,
                                _props_digest(d, w), geo.x, geo.y])
            except Exception:  # noqa: BLE001 - a window that went away meanwhile
                continue
        return {
            "controls": _x_controls(d),
            "xkb": _Xkb.read(display),
            "orphan_clients": len(_x_orphans(d)),
            # what a screenshot sees of the desktop's background (xsetroot sets no property)
            "background": root.get_image(s.width_in_pixels // 2, s.height_in_pixels // 3, 1, 1, X.ZPixmap,
                                         0xFFFFFFFF).data.hex(),
            "screen": [s.width_in_pixels, s.height_in_pixels],
            "root_properties": props,
            "selections": selections,
            "pointer": [ptr.root_x, ptr.root_y, ptr.mask],
            "pressed_keys": pressed,
            "keyboard_mapping": mapping,
            "windows": sorted(windows, key=json.dumps),
        }


def _wait_wm(display: str, want: dict[str, Any], timeout: float = 3.0, conn: Any = None) -> dict[str, Any]:
    """The X state once the window manager has caught up with the windows that went away (its
    client list and active window are updated asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        state = _x_state(display, conn)
        props = state["root_properties"]
        same = all(props.get(k) == want["root_properties"].get(k) for k in WM_MANAGED) if want else True
        if same or time.monotonic() > deadline:
            return state
        time.sleep(0.005)


def _props_digest(d: Any, w: Any) -> str:
    """A short hash of a window's properties (window and pixmap ids counted, atoms by name)."""
    rows = []
    for name, (ptype, fmt, value) in sorted(_raw_root_properties(d, w).items()):
        if ptype in (Xatom.WINDOW, Xatom.PIXMAP):
            value = sum(1 for v in value if v)
        elif ptype == Xatom.ATOM:  # atom numbers depend on the order clients interned them
            value = sorted(_atom_name(d, v) for v in value)
        elif isinstance(value, bytes):
            value = value.hex()
        elif not isinstance(value, str):
            value = list(value)
        rows.append([name, _atom_name(d, ptype) if ptype else "", fmt, value])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _restore_properties(d: Any, w: Any, base: dict[str, tuple[int, int, Any]], skip: frozenset[str]) -> None:
    """Put ``w``'s properties back to ``base`` (added ones deleted, changed or deleted ones set)."""
    now = _raw_root_properties(d, w)
    for name, (ptype, fmt, value) in now.items():
        if name in skip:
            continue
        if name not in base:
            w.delete_property(d.intern_atom(name))
        elif base[name] != (ptype, fmt, value):
            btype, bfmt, bvalue = base[name]
            w.change_property(d.intern_atom(name), btype, bfmt, bvalue)
    for name, (btype, bfmt, bvalue) in base.items():
        if name not in now and name not in skip:
            w.change_property(d.intern_atom(name), btype, bfmt, bvalue)


def _geometry(w: Any) -> tuple[int, int, int, int, int, bool]:
    g = w.get_geometry()
    return (g.x, g.y, g.width, g.height, g.border_width, w.get_attributes().map_state != X.IsUnmapped)


def _restore_geometry(w: Any, base: tuple[int, int, int, int, int, bool] | None) -> None:
    """A baseline window (the panel) moved, resized or (un)mapped by a client: put back."""
    if base is None:
        return
    now = _geometry(w)
    if now[:5] != base[:5]:
        w.configure(x=base[0], y=base[1], width=base[2], height=base[3], border_width=base[4])
    if now[5] != base[5]:
        w.map() if base[5] else w.unmap()


def _raw_root_properties(d: Any, window: Any = None) -> dict[str, tuple[int, int, Any]]:
    """The properties of the root window (or of ``window``): name -> (type, format, value)."""
    root = d.screen().root if window is None else window
    out = {}
    for atom in root.list_properties():
        p = root.get_full_property(atom, X.AnyPropertyType)
        if p is not None:
            out[_atom_name(d, atom)] = (p.property_type, p.format, p.value)
    return out


def _x_controls(d: Any) -> dict[str, Any]:
    """The X server's settings a client can change and that outlive it (``xmodmap``, ``xset``,
    ``xhost``): button and modifier mappings, keyboard and pointer controls, screen saver, font
    path, access control. A next episode's clicks, shortcuts and screenshots depend on them."""
    kbd = d.get_keyboard_control()
    ptr = d.get_pointer_control()
    saver = d.get_screen_saver()
    hosts = d.list_hosts()
    return {
        "pointer_mapping": list(d.get_pointer_mapping()),
        "modifier_mapping": [list(m) for m in d.get_modifier_mapping()],
        "keyboard": [kbd.global_auto_repeat, kbd.led_mask, kbd.key_click_percent, kbd.bell_percent,
                     kbd.bell_pitch, kbd.bell_duration, list(kbd.auto_repeats)],
        "pointer": [ptr.accel_num, ptr.accel_denom, ptr.threshold],
        "screen_saver": [saver.timeout, saver.interval, saver.prefer_blanking, saver.allow_exposures],
        "font_path": list(d.get_font_path()),
        "access": [hosts.mode, sorted([h.family, list(h.name)] for h in hosts.hosts)],
    }


class _Xkb:
    """The XKB state python-xlib cannot reach, through libX11 (ctypes): the enabled controls and
    their parameters (StickyKeys, SlowKeys, BounceKeys, MouseKeys, repeat rate ...: ``XkbControlsRec``)
    and the locked and latched modifiers and group (Caps Lock, Num Lock). An agent's SlowKeys
    would swallow the next episode's typing, a Caps Lock left on would change it."""

    USE_CORE_KBD = 0x100
    ALL_CONTROLS = 0xF8001FFF  # XkbAllControlsMask
    CONTROLS_SIZE = 84  # sizeof(XkbControlsRec)

    class Desc(ctypes.Structure):  # the head of XkbDescRec
        _fields_ = [("dpy", ctypes.c_void_p), ("flags", ctypes.c_ushort), ("device_spec", ctypes.c_ushort),
                    ("min_key_code", ctypes.c_ubyte), ("max_key_code", ctypes.c_ubyte), ("ctrls", ctypes.c_void_p)]

    class State(ctypes.Structure):  # XkbStateRec
        _fields_ = [("group", ctypes.c_ubyte), ("locked_group", ctypes.c_ubyte), ("base_group", ctypes.c_ushort),
                    ("latched_group", ctypes.c_ushort), ("mods", ctypes.c_ubyte), ("base_mods", ctypes.c_ubyte),
                    ("latched_mods", ctypes.c_ubyte), ("locked_mods", ctypes.c_ubyte), ("compat_state", ctypes.c_ubyte),
                    ("grab_mods", ctypes.c_ubyte), ("compat_grab_mods", ctypes.c_ubyte),
                    ("lookup_mods", ctypes.c_ubyte), ("compat_lookup_mods", ctypes.c_ubyte),
                    ("ptr_buttons", ctypes.c_ushort)]

    _lib: Any = None
    # libX11's default error handler exits the process: this one ignores (the answer read after says)
    _on_error = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda dpy, ev: 0)

    @classmethod
    def lib(cls) -> Any:
        if cls._lib is None:
            x = ctypes.CDLL(ctypes.util.find_library("X11") or "libX11.so.6")
            x.XOpenDisplay.restype = ctypes.c_void_p
            x.XOpenDisplay.argtypes = [ctypes.c_char_p]
            x.XCloseDisplay.argtypes = [ctypes.c_void_p]
            x.XSync.argtypes = [ctypes.c_void_p, ctypes.c_int]
            x.XkbAllocKeyboard.restype = ctypes.POINTER(cls.Desc)
            x.XkbFreeKeyboard.argtypes = [ctypes.POINTER(cls.Desc), ctypes.c_uint, ctypes.c_int]
            x.XkbGetControls.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(cls.Desc)]
            x.XkbSetControls.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(cls.Desc)]
            x.XkbGetState.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(cls.State)]
            for f in ("XkbLockModifiers", "XkbLatchModifiers"):
                getattr(x, f).argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]
            for f in ("XkbLockGroup", "XkbLatchGroup"):
                getattr(x, f).argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            x.XSetErrorHandler.argtypes = [ctypes.c_void_p]
            x.XSetErrorHandler(ctypes.cast(cls._on_error, ctypes.c_void_p))
            cls._lib = x
        return cls._lib

    @classmethod
    def read(cls, display: str, restore: dict[str, Any] | None = None) -> dict[str, Any]:
        """``{"controls": hex, "state": [...]}``; with ``restore`` (an earlier answer), put that back
        first (what differs only). ``{}`` where libX11 or XKB is missing."""
        try:
            x = cls.lib()
        except OSError:
            return {}
        dpy = x.XOpenDisplay(display.encode())
        if not dpy:
            return {}
        desc = x.XkbAllocKeyboard()
        try:
            if not desc:
                return {}
            desc.contents.device_spec = cls.USE_CORE_KBD
            out = cls._get(x, dpy, desc)
            if restore and out != restore:
                if out["controls"] != restore["controls"]:
                    ctypes.memmove(desc.contents.ctrls, bytes.fromhex(restore["controls"]), cls.CONTROLS_SIZE)
                    x.XkbSetControls(dpy, cls.ALL_CONTROLS, desc)
                locked_mods, latched_mods, locked_group, latched_group = restore["state"]
                x.XkbLockModifiers(dpy, cls.USE_CORE_KBD, 0xFF, locked_mods)
                x.XkbLatchModifiers(dpy, cls.USE_CORE_KBD, 0xFF, latched_mods)
                x.XkbLockGroup(dpy, cls.USE_CORE_KBD, locked_group)
                x.XkbLatchGroup(dpy, cls.USE_CORE_KBD, latched_group)
                x.XSync(dpy, 0)
                out = cls._get(x, dpy, desc)
            return out
        finally:
            if desc:
                x.XkbFreeKeyboard(desc, 0, 1)
            x.XCloseDisplay(dpy)

    @classmethod
    def _get(cls, x: Any, dpy: int, desc: Any) -> dict[str, Any]:
        if x.XkbGetControls(dpy, cls.ALL_CONTROLS, desc) != 0 or not desc.contents.ctrls:
            return {}
        st = cls.State()
        x.XkbGetState(dpy, cls.USE_CORE_KBD, ctypes.byref(st))
        return {"controls": ctypes.string_at(desc.contents.ctrls, cls.CONTROLS_SIZE).hex(),
                "state": [st.locked_mods, st.latched_mods, st.locked_group, st.latched_group]}


def _x_orphans(d: Any) -> list[int]:
    """The X clients with no process behind them, by resource base: what a client left past its
    connection with ``XSetCloseDownMode(RetainPermanent)`` (windows inside other clients' windows,
    selections, properties that no window list shows). The server's own (base 0) is not one."""
    try:
        clients = d.res_query_clients().clients
        ids = d.res_query_client_ids([{"client": c.resource_base, "mask": res.LocalClientPIDMask}
                                      for c in clients if c.resource_base])
    except Exception:  # noqa: BLE001 - no X-Resource extension: nothing to say
        return []
    pids = {i.spec.client: (i.value[0] if i.value else -1) for i in ids.ids}
    return sorted(c.resource_base for c in clients
                  if c.resource_base and not (pids.get(c.resource_base, -1) > 0
                                              and os.path.exists(f"/proc/{pids[c.resource_base]}")))


def _kill_orphans(d: Any) -> None:
    """Free what :func:`_x_orphans` found. KillClient names a client by one of its resources: its
    windows, anywhere in the tree (what other clients can see of an orphan is on a window; one
    with none left, only pixmaps or GCs, still counts in the fingerprint: a cold restart)."""
    orphans = _x_orphans(d)
    if not orphans:
        return
    mask = d.res_query_clients().clients[0].resource_mask
    found: dict[int, int] = {}
    todo = [d.screen().root]
    while todo:
        w = todo.pop()
        with contextlib.suppress(Exception):
            for child in w.query_tree().children:
                todo.append(child)
                base = child.id & ~mask
                if base in orphans and base not in found:
                    found[base] = child.id
                    child.kill_client(onerror=xerror.CatchError())
    d.sync()


def _x_restore_controls(d: Any, base: dict[str, Any]) -> None:
    """Put :func:`_x_controls` back to ``base`` (what differs only)."""
    now = _x_controls(d)
    if not base or now == base:
        return
    if now["pointer_mapping"] != base["pointer_mapping"]:
        for _ in range(20):  # MappingBusy while a button is still down
            if d.set_pointer_mapping(base["pointer_mapping"]) == X.MappingSuccess:
                break
            time.sleep(0.005)
    if now["modifier_mapping"] != base["modifier_mapping"]:
        for _ in range(20):
            if d.set_modifier_mapping(base["modifier_mapping"]) == X.MappingSuccess:
                break
            time.sleep(0.005)
    if now["keyboard"] != base["keyboard"]:
        auto, leds, click, bell, pitch, duration, repeats = base["keyboard"]
        d.change_keyboard_control(key_click_percent=click, bell_percent=bell, bell_pitch=pitch,
                                  bell_duration=duration)
        for i in range(32):
            if (leds ^ now["keyboard"][1]) & (1 << i):
                d.change_keyboard_control(led=i + 1, led_mode=X.LedModeOn if leds & (1 << i) else X.LedModeOff)
        for i, (b, n) in enumerate(zip(repeats, now["keyboard"][6], strict=False)):
            for bit in range(8):
                if (b ^ n) & (1 << bit) and i * 8 + bit >= 8:
                    d.change_keyboard_control(key=i * 8 + bit, auto_repeat_mode=X.AutoRepeatModeOn
                                              if b & (1 << bit) else X.AutoRepeatModeOff)
        d.change_keyboard_control(auto_repeat_mode=X.AutoRepeatModeOn if auto else X.AutoRepeatModeOff)
    if now["pointer"] != base["pointer"]:
        num, den, threshold = base["pointer"]
        d.change_pointer_control(accel=(num, den), threshold=threshold)
    if now["screen_saver"] != base["screen_saver"]:
        d.set_screen_saver(*base["screen_saver"])
    if now["font_path"] != base["font_path"]:
        d.set_font_path(base["font_path"])
    if now["access"] != base["access"]:
        mode, hosts = base["access"]
        have = {json.dumps(h) for h in now["access"][1]}
        want = {json.dumps(h) for h in hosts}
        for h in have - want:
            family, name = json.loads(h)
            d.change_hosts(X.HostDelete, family, name)
        for h in want - have:
            family, name = json.loads(h)
            d.change_hosts(X.HostInsert, family, name)
        d.set_access_control(mode)


def _x_reset(display: str, base: Baseline, conn: Any = None) -> None:
    """Release keys and buttons, pointer back, selections dropped, what clients with no process
    left behind freed, root properties and the server's settings back to the baseline's."""
    with _x_connection(display, conn) as d:
        root = d.screen().root
        keymap = d.query_keymap()
        for i, byte in enumerate(keymap):
            for b in range(8):
                if byte & (1 << b):
                    xtest.fake_input(d, X.KeyRelease, i * 8 + b)
        mask = root.query_pointer().mask
        for button, bit in ((1, X.Button1Mask), (2, X.Button2Mask), (3, X.Button3Mask), (4, X.Button4Mask),
                            (5, X.Button5Mask)):
            if mask & bit:
                xtest.fake_input(d, X.ButtonRelease, button)
        d.sync()
        for sel in ("PRIMARY", "SECONDARY", "CLIPBOARD"):
            atom = d.intern_atom(sel)
            if d.get_selection_owner(atom):
                d.set_selection_owner(atom, X.NONE, X.CurrentTime)
        # Clients whose process is gone (every agent process is): their windows and resources.
        # Not every new top-level window: one of the window manager's frames would take it along.
        _kill_orphans(d)
        d.sync()
        d.sync()
        _Xkb.read(display, restore=base.xkb)
        _x_restore_controls(d, base.controls)
        d.force_screen_saver(X.ScreenSaverReset)
        _restore_properties(d, root, base.root_properties, WM_MANAGED)
        # the baseline's windows (the panel's, the window manager's): any client may set their
        # properties (a strut, a message for the next episode)
        for w in root.query_tree().children:
            if w.id in base.window_properties:
                with contextlib.suppress(Exception):  # a window that went away meanwhile
                    _restore_properties(d, w, base.window_properties[w.id], frozenset())
                    _restore_geometry(w, base.window_geometry.get(w.id))
        # the root's background (xsetroot; the guest's own wallpaper route refuses a warm reset):
        # the server's default, which the cold start has
        root.change_attributes(background_pixmap=X.NONE)
        root.clear_area(0, 0, 0, 0)
        xtest.fake_input(d, X.MotionNotify, x=base.pointer[0], y=base.pointer[1])
        if "_NET_ACTIVE_WINDOW" not in base.active:
            # nothing had the focus at the cold start: give it back to the root (the window
            # manager then clears its active window, as after a cold start)
            d.set_input_focus(X.PointerRoot, X.RevertToPointerRoot, X.CurrentTime)
            root.delete_property(d.intern_atom("_NET_ACTIVE_WINDOW"))
        d.sync()


# -- baseline, fingerprint, reset ---------------------------------------------------------------


@dataclass
class Baseline:
    home_archive: bytes  # the helper's snapshot of the home
    keep: dict[str, list[str]]  # writable tree -> the relative paths it held
    root_properties: dict[str, tuple[int, int, Any]]
    windows: set[int]
    pointer: tuple[int, int]
    screen: tuple[int, int]
    exchange: set[str]
    controls: dict[str, Any] = field(default_factory=dict)  # _x_controls at the baseline
    xkb: dict[str, Any] = field(default_factory=dict)  # _Xkb.read at the baseline
    window_properties: dict[int, dict[str, tuple[int, int, Any]]] = field(default_factory=dict)  # top-level
    window_geometry: dict[int, tuple[int, int, int, int, int, bool]] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)  # the WM-managed root properties set at the baseline
    fingerprint: dict[str, Any] = field(default_factory=dict)


_lock = threading.Lock()


def fingerprint(desk: Desktop, scan: dict[str, Any] | None = None, x: dict[str, Any] | None = None) -> dict[str, Any]:
    """The desktop's state (see the module doc) with its ``digest`` (``scan``, ``x``: the helper's
    scan and the X state, where the caller has just taken them)."""
    if scan is None:
        scan = json.loads(_helper(desk, "scan", desk.home))
    exchange = sorted(os.listdir(desk.exchange_dir)) if desk.exchange_dir else []
    fp: dict[str, Any] = {
        "processes": _processes(desk),
        "files": _files(scan),
        "x": x if x is not None else _x_state(desk.display),
        "guest": {"exchange": exchange, "wallpaper": desk.wallpaper is not None},
        "ipc": _sysv_ipc(),
        "agent_world": _agent_world_view(),
    }
    fp["digest"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
    return fp


def take_baseline(desk: Desktop) -> dict[str, Any]:
    """Record the state a warm reset goes back to (call once the cold start is ready, before any
    agent action); returns its fingerprint."""
    if desk.agent is None:
        raise WarmResetError("warm resets need a box (the agent's own namespaces)")
    with contextlib.suppress(ImportError):  # what a warm reset's bus restart uses: loaded now, not then
        from gi.repository import Gio, GLib  # noqa: F401
    # The interpreter's start-up runs agent processes of its own (pyautogui's import asks `which
    # scrot`): over before the baseline, or a loaded machine records one and every reset differs.
    desk.runner.start()
    with _lock:
        _atom_names.clear()
        _wait_settled(desk)
        home_archive = _helper(desk, "snapshot", desk.home)
        scan = json.loads(_helper(desk, "scan", desk.home))
        keep = {t: [e[0] for e in scan.get(t, [])] for t in WRITABLE}
        d = xdisplay.Display(desk.display)
        try:
            root = d.screen().root
            props = _raw_root_properties(d)
            windows = {w.id for w in root.query_tree().children}
            tops = {w: d.create_resource_object("window", w) for w in windows}
            window_properties = {w: _raw_root_properties(d, obj) for w, obj in tops.items()}
            window_geometry = {w: _geometry(obj) for w, obj in tops.items()}
            ptr = root.query_pointer()
            s = d.screen()
            screen = (s.width_in_pixels, s.height_in_pixels)
            controls = _x_controls(d)
        finally:
            d.close()
        base = Baseline(
            home_archive=home_archive, keep=keep, root_properties=props, windows=windows,
            window_properties=window_properties, window_geometry=window_geometry,
            pointer=(ptr.root_x, ptr.root_y), screen=screen, controls=controls, xkb=_Xkb.read(desk.display),
            active={k for k in WM_MANAGED if k in props and any(props[k][2])},
            exchange=set(os.listdir(desk.exchange_dir)) if desk.exchange_dir else set(),
        )
        base.fingerprint = fingerprint(desk, scan)
        desk.warm_baseline = base
        return base.fingerprint


def _wait_settled(desk: Desktop, timeout: float = 15.0) -> None:
    """Wait until the session's start is over: the AT-SPI registry runs (where there is an AT-SPI
    bus) and the processes and windows stay the same for a moment."""
    def look() -> tuple[list[str], list[tuple[int, int, int]]]:
        d = xdisplay.Display(desk.display)
        try:
            wins = []
            for w in d.screen().root.query_tree().children:
                with contextlib.suppress(Exception):
                    g = w.get_geometry()
                    wins.append((w.get_attributes().map_state, g.width, g.height))
            width = d.screen().width_in_pixels
        finally:
            d.close()
        procs = _processes(desk)
        # the panel maps its window about a second after it starts
        panel = not any("tint2" in p for p in procs) or any(m and w == width for m, w, _ in wins)
        return procs, sorted(wins) if panel else []

    deadline = time.monotonic() + timeout
    last = look()
    while time.monotonic() < deadline:
        time.sleep(0.15)
        now = look()
        registry = not any("at-spi-bus-launcher" in p for p in now[0]) or any("registryd" in p for p in now[0])
        if now == last and now[1] and registry:
            return
        last = now


def warm_reset(desk: Desktop) -> dict[str, Any]:
    """Put the desktop back to its baseline (see the module doc); returns the new fingerprint (only
    its ``digest`` where it is the baseline's) with ``timings_ms``. Raises WarmResetError where it
    cannot (the farm restarts the box cold). The caller starts the interpreter again
    (``desk.restart_runner``)."""
    base: Baseline | None = getattr(desk, "warm_baseline", None)
    if desk.agent is None:
        raise WarmResetError("warm resets need a box (the agent's own namespaces)")
    if base is None:
        raise WarmResetError("no baseline: the desktop was not prepared for warm resets")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    def mark(what: str) -> None:
        timings[what] = round((time.perf_counter() - t0) * 1000, 1)

    with _lock:
        if desk.wallpaper is not None:
            raise WarmResetError("a wallpaper was set")
        kill_agent_processes(set())  # every one: the buses too (a task could have tampered with them)
        mark("kill")
        desk.reset_helpers()  # the interpreter (killed above: no graceful wait), recorder, input bindings
        _reap_agent_zombies()
        mark("killed")
        # From here on no process of the agent's runs but the ones started below: the helper (its
        # files, as its root) and, once the files are back, its buses.
        old_a11y = [os.path.join("/tmp", n) for n in os.listdir("/tmp") if n.startswith("osfarm-a11y-")]
        helper = _HelperSession(desk, "reset", desk.home)
        xconn = None
        try:
            xconn = xdisplay.Display(desk.display)  # one X connection for the reset and the state after
            keep = b"\0".join(os.fsencode(os.path.join(top, rel)) for top, rels in base.keep.items() for rel in rels)
            emptied = b"\0".join(os.fsencode(d) for d in old_a11y)
            helper.send(b"%d %d %d\n" % (len(keep), len(emptied), len(base.home_archive))
                        + keep + emptied + base.home_archive)
            # while the helper starts and restores the files: X (no file of the agent's matters to it)
            _x_reset(desk.display, base, xconn)
            if desk.exchange_dir:
                for name in set(os.listdir(desk.exchange_dir)) - base.exchange:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(desk.exchange_dir, name))
            mark("x")
            if helper.line() != b"restored":
                raise WarmResetError("agent-side helper: unexpected answer")
            mark("files")
            # the helper scans the home and the agent's /etc meanwhile (the buses write neither)
            if desk.restart_buses is not None:
                steps = desk.restart_buses()
                for d in old_a11y:  # the old AT-SPI bus's dirs (the guest's)
                    shutil.rmtree(d, ignore_errors=True)
                timings.update({f"buses.{k}": v for k, v in (steps or {}).items()})
            mark("buses")
            scan = json.loads(helper.line())
            mark("scanned")
            helper.send(b"scan\n")
            # while it scans the writable trees: X, once the window manager caught up
            state = _wait_wm(desk.display, base.fingerprint.get("x", {}), conn=xconn)
            mark("wm")
            scan.update(json.loads(helper.finish()))
            mark("scan")
        finally:
            helper.close()
            if xconn is not None:
                xconn.close()
        if tuple(state["screen"]) != base.screen:
            raise WarmResetError(f"the screen size changed to {state['screen']}")
        fp = fingerprint(desk, scan, x=state)  # the helper is gone: the process list is the desktop's
        mark("fingerprint")
    # The interpreter is started again by the caller, once its answer is out (the route's
    # background task): nothing waits for it. The farm compares digests: the whole fingerprint
    # goes back only where it differs from the baseline's (the farm then says where).
    if fp["digest"] == base.fingerprint.get("digest"):
        fp = {"digest": fp["digest"]}
    fp["timings_ms"] = timings  # not part of the digest
    return fp


def differences(a: dict[str, Any], b: dict[str, Any], limit: int = 8) -> list[str]:
    """Where two fingerprints differ, as short paths (for the log and the fallback's reason)."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if len(out) >= limit or x == y:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{path}.{k}" if path else k)
        elif isinstance(x, list) and isinstance(y, list) and path.count(".") < 2:
            sx = {json.dumps(e, sort_keys=True) for e in x}
            sy = {json.dumps(e, sort_keys=True) for e in y}
            for e in sorted(sx - sy)[:3]:
                out.append(f"{path}: only before {e[:160]}")
            for e in sorted(sy - sx)[:3]:
                out.append(f"{path}: only after {e[:160]}")
            if sx == sy:
                out.append(f"{path}: order")
        else:
            out.append(f"{path}: {json.dumps(x)[:120]} != {json.dumps(y)[:120]}")

    skip = ("digest", "timings_ms")
    walk({k: v for k, v in a.items() if k not in skip}, {k: v for k, v in b.items() if k not in skip}, "")
    return out[:limit]
