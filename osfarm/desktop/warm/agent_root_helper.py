"""A warm reset's file work and the fingerprint's file scans, done by one helper program run as
the agent's root in the agent's namespaces (its user and mount namespaces; a plain desktop: this
process's): the home's snapshot (the baseline's archive) and its restore, the writable trees
(``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/dev/mqueue``, the agent's ``/run``) pruned back to the
baseline's paths, and scans of the home, the agent's ``/etc``, its mounts and the writable trees.

The program is handed to the box's ``python3 -I -S -c`` as source text (standard library only, no
site: nothing of osfarm's package is imported in the agent's world). :func:`run_helper` runs one
mode to its end; :class:`HelperSession` speaks to the ``reset`` mode in steps while the guest puts
the X state back and restarts the agent's buses.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import threading
import time
from typing import TYPE_CHECKING

from osfarm.desktop.warm.warm_reset_error import WarmResetError

if TYPE_CHECKING:
    from osfarm.desktop.session.guest_state import Desktop

# The writable trees (the helper's program has its own copy: keep the two the same).
WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run")
HELPER_TIMEOUT_S = 20.0


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


def run_helper(desk: Desktop, *args: str, stdin: bytes = b"") -> bytes:
    proc = subprocess.run(_agent_root_argv(desk, *args), input=stdin, capture_output=True,
                          timeout=HELPER_TIMEOUT_S, check=False, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    if proc.returncode != 0:
        raise WarmResetError(f"agent-side helper {args[0]} failed ({proc.returncode}): "
                             f"{proc.stderr.decode(errors='replace')[-500:]}")
    return proc.stdout


class HelperSession:
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


