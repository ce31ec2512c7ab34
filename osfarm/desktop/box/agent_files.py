"""The guest's file routes done as the agent's user: read, write, list and stat a path in the
agent's world (:mod:`osfarm.desktop.box.agent_world`).

The guest runs as another uid than the agent, so it could not read the agent's private files
(Chromium's profile is 0700), and it must not open paths the agent controls with its own rights
(a symlink in the home pointing at the guest's token). So every file operation a route does for
a caller is a small helper program run with the agent's ``python3 -I -S`` (standard library
only, nothing the agent's environment can inject) as the agent's user: it sees and may touch
exactly what the agent may, as OSWorld's server (running as ``user``) does. Its output is the
agent's world's word, like everything read from the box.

Protocol: the helper writes one JSON line (``{"ok": true, ...}`` or ``{"error": kind, ...}``),
then, for reads, the file's bytes. Reads are capped (:data:`MAX_READ_BYTES`): a file over the
cap (a 100 GB sparse "result") is refused before any byte is sent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from osfarm.desktop.box.agent_world import AgentWorld
from osfarm.errors import OsfarmError

MAX_READ_BYTES = 1 << 30
# The agent's python3, found on its PATH: the system one with pyautogui in /usr/local (sandbox),
# whatever the image links there (Docker, VMs).
AGENT_PYTHON = "python3"
HELPER_TIMEOUT_S = 60.0
CHUNK = 1 << 20
MAX_REPLY_BYTES = 64 << 20  # a directory tree's JSON

_HELPER = r'''
import json, os, stat, sys

def out(obj):
    sys.stdout.buffer.write((json.dumps(obj) + "\n").encode())
    sys.stdout.buffer.flush()

def tree(path, limit):
    count = [0]
    def walk(p):
        count[0] += 1
        node = {"type": "directory", "name": os.path.basename(p.rstrip("/")) or p, "children": []}
        if count[0] > limit:
            return node
        try:
            names = sorted(os.listdir(p))
        except OSError:
            return node
        for n in names:
            full = os.path.join(p, n)
            if os.path.isdir(full) and not os.path.islink(full):
                node["children"].append(walk(full))
            else:
                count[0] += 1
                node["children"].append({"type": "file", "name": n})
        return node
    return walk(path)

op, path = sys.argv[1], sys.argv[2]
try:
    if op == "stat":
        st = os.stat(path)
        out({"ok": True, "dir": stat.S_ISDIR(st.st_mode), "file": stat.S_ISREG(st.st_mode), "size": st.st_size})
    elif op == "read":
        limit = int(sys.argv[3])
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            out({"error": "isdir"})
        elif not stat.S_ISREG(st.st_mode):
            out({"error": "notfile"})
        elif st.st_size > limit:
            out({"error": "toolarge", "size": st.st_size})
        else:
            os.set_blocking(fd, True)
            out({"ok": True, "size": st.st_size})
            left = st.st_size
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                sys.stdout.buffer.write(chunk)
                left -= len(chunk)
            sys.stdout.buffer.write(b"\0" * left)  # a file that shrank meanwhile: keep the promised size
            sys.stdout.buffer.flush()
    elif op == "write":
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        tmp = "%s.part-%d" % (path, os.getpid())
        try:
            with open(tmp, "wb") as f:
                while True:
                    chunk = sys.stdin.buffer.read(1 << 20)
                    if not chunk:
                        break
                    f.write(chunk)
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        out({"ok": True, "size": os.path.getsize(path)})
    elif op == "list":
        if not os.path.isdir(path):
            out({"error": "notdir"})
        else:
            out({"ok": True, "tree": tree(path, int(sys.argv[3]))})
    else:
        out({"error": "badop"})
except FileNotFoundError:
    out({"error": "notfound"})
except (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError, OSError) as e:
    out({"error": "oserror", "message": e.strerror or str(e)})
'''


class AgentFileError(OsfarmError):
    """What the helper said instead of ``ok``: ``kind`` is notfound, isdir, notdir, notfile,
    toolarge, oserror (``message`` says more) or helper (it failed or said nothing)."""

    def __init__(self, kind: str, message: str = "", size: int | None = None):
        super().__init__(message or kind)
        self.kind = kind
        self.message = message or kind
        self.size = size


@dataclass
class AgentFiles:
    """File operations through the agent's world; ``script_dir`` is a dir the agent can read
    (the guest writes the helper there once)."""

    world: AgentWorld
    env: dict[str, str]
    script_dir: str
    python: str = AGENT_PYTHON

    def __post_init__(self) -> None:
        self.script = os.path.join(self.script_dir, "osfarm_files.py")
        fd = os.open(self.script, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_HELPER)

    def _argv(self, *args: str) -> list[str]:
        return self.world.command([self.python, "-I", "-S", self.script, *args], cwd="/")

    def _call(self, *args: str) -> dict[str, Any]:
        """Run the helper; its reply is read up to MAX_REPLY_BYTES (the agent may have replaced
        the program it runs, so nothing it says is trusted to be small or well-formed)."""
        proc = subprocess.Popen(self._argv(*args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self.env)
        assert proc.stdout is not None and proc.stderr is not None  # both are PIPEs
        timer = threading.Timer(HELPER_TIMEOUT_S, proc.kill)
        timer.start()
        try:
            out = proc.stdout.read(MAX_REPLY_BYTES + 1)
            err = proc.stderr.read(4096) if len(out) <= MAX_REPLY_BYTES else b""
        finally:
            timer.cancel()
            proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        if len(out) > MAX_REPLY_BYTES:
            raise AgentFileError("helper", f"the file helper's reply is over {MAX_REPLY_BYTES} bytes")
        return _header(out.split(b"\n", 1)[0], err)

    def stat(self, path: str) -> dict[str, Any]:
        return self._call("stat", path)

    def list_tree(self, path: str, max_entries: int = 200_000) -> dict[str, Any]:
        return self._call("list", path, str(max_entries))["tree"]

    def write(self, path: str, src: IO[bytes]) -> int:
        """Write ``src`` (a binary file object) to ``path`` as the agent; returns the size."""
        proc = subprocess.Popen(self._argv("write", path), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self.env)
        assert proc.stdin is not None
        try:
            shutil.copyfileobj(src, proc.stdin, CHUNK)
        except BrokenPipeError:
            pass
        finally:
            proc.stdin.close()
        assert proc.stdout is not None and proc.stderr is not None
        timer = threading.Timer(HELPER_TIMEOUT_S, proc.kill)
        timer.start()
        try:
            out = proc.stdout.readline(1 << 16)
            err = proc.stderr.read(4096)
        finally:
            timer.cancel()
            proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        return int(_header(out, err)["size"])

    def open_read(self, path: str, limit: int = MAX_READ_BYTES) -> tuple[int, Iterator[bytes]]:
        """(size, chunks) of a file; raises AgentFileError before any byte when it cannot be
        read or is over ``limit``."""
        proc = subprocess.Popen(self._argv("read", path, str(limit)), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=self.env)
        assert proc.stdout is not None
        try:
            head = _header(proc.stdout.readline(1 << 16), b"")
        except BaseException:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            raise
        size = int(head["size"])
        if not 0 <= size <= limit:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            raise AgentFileError("toolarge", size=size)

        def chunks() -> Iterator[bytes]:
            assert proc.stdout is not None
            left = size
            try:
                while left > 0:
                    data = proc.stdout.read(min(CHUNK, left))
                    if not data:
                        break
                    left -= len(data)
                    yield data
            finally:
                proc.kill()
                proc.wait()
                proc.stdout.close()

        return size, chunks()

    def read_bytes(self, path: str, limit: int) -> bytes:
        _size, chunks = self.open_read(path, limit)
        return b"".join(chunks)


def _header(line: bytes, stderr: bytes) -> dict[str, Any]:
    try:
        head = json.loads(line)
    except ValueError:
        why = stderr.decode(errors="replace").strip()[-500:] or "no reply"
        raise AgentFileError("helper", f"the file helper failed: {why}") from None
    if not isinstance(head, dict):
        raise AgentFileError("helper", "the file helper gave no object")
    if head.get("ok"):
        return head
    raise AgentFileError(str(head.get("error", "helper")), str(head.get("message", "")), head.get("size"))
