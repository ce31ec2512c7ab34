"""The host side of the sandbox's box template (``sandbox_start: fork``).

:class:`BoxTemplate` starts :mod:`osfarm.desktop.launch.box_zygote` (as root, in a mount namespace of
its own where ``/opt/osfarm`` is what a box sees; a parent-death signal ties it to the farm's
thread), talks to it over one end of a socketpair that only it inherited, and asks it for one box
per start. :class:`ForkedBox` is what the provider holds for a forked box: the surface of
``asyncio.subprocess.Process`` the provider uses (``pid``, ``returncode``, ``wait()``), the pid
being the box's top process (a child of the template, not of the farm), whose child is the box's
PID 1. Its exit status comes from the template (which reaps it); where the template died first,
the box's pidfd says it is gone (its boxes die with it: parent-death signals) and its returncode
is -SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from osfarm.errors import OsfarmError

log = logging.getLogger("osfarm.providers.sandbox")

READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 10.0
MSG_MAX = 65536


class TemplateError(OsfarmError, RuntimeError):
    """The template could not start or could not fork a box; the message says why."""


class ForkedBox:
    """A forked box's top process, seen as an ``asyncio.subprocess.Process``."""

    def __init__(self, pid: int, template_gone: bool):
        self.pid = pid
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[int] = self._loop.create_future()
        self._exited = False  # its pidfd fired: the process is gone (its status may come later)
        self._template_gone = template_gone
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already: the template's report gives its status
            self._pidfd = None
            self._exited = True
        else:
            self._loop.add_reader(self._pidfd, self._on_exit)
        if self._exited and template_gone:
            self.finish(-signal.SIGKILL)

    def _on_exit(self) -> None:
        self._close_pidfd()
        self._exited = True
        if self._template_gone:
            self.finish(-signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def finish(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._done.set_result(returncode)
        self._close_pidfd()

    def template_gone(self) -> None:
        """No status will be reported: the exit itself (pidfd) is the last word."""
        self._template_gone = True
        if self._exited:
            self.finish(-signal.SIGKILL)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


class BoxTemplate:
    """One template process and its channel (see the module doc)."""

    def __init__(self, tag: str, binds: list[tuple[str, str]], env: dict[str, str], box_python: str,
                 log_path: Path):
        self.tag = tag  # on the template's command line (and so its forks'): orphan reaping finds them
        self.binds = [list(b) for b in binds]
        self.env = env
        self.box_python = box_python
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.info: dict = {}
        self._chan: socket.socket | None = None
        self._eof = False
        self._ready: asyncio.Future[dict] | None = None
        self._replies: dict[int, asyncio.Future[dict]] = {}
        self._boxes: dict[int, ForkedBox] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self._eof

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = theirs.fileno()
        spec = json.dumps({"binds": self.binds, "env": self.env})
        argv = [sys.executable, "-m", "osfarm.desktop.launch.box_zygote", "--mounts", spec,
                "--parent", str(os.getpid()),
                "--tag", self.tag, "--", self.box_python, "-P", "-m", "osfarm.desktop.launch.box_zygote", "--serve",
                str(fd), "--tag", self.tag]
        host_env = {k: os.environ[k] for k in ("LANG", "LC_ALL", "TZ", "PATH", "PYTHONPATH") if k in os.environ}
        try:
            with open(self.log_path, "ab") as logf:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    start_new_session=True, env=host_env, pass_fds=(fd,))
        except OSError as e:
            ours.close()
            raise TemplateError(f"starting the box template: {e}") from None
        finally:
            theirs.close()
        ours.setblocking(False)
        self._chan = ours
        self._ready = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_readable)
        try:
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), READY_TIMEOUT_S)
        except (TimeoutError, TemplateError) as e:
            await self.close()
            raise TemplateError(f"the box template did not start ({e or 'timeout'}): {_tail(self.log_path)}") \
                from None

    def _on_readable(self) -> None:
        assert self._chan is not None
        while True:
            try:
                data = self._chan.recv(MSG_MAX)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._gone()
                return
            self._handle(json.loads(data))

    def _handle(self, msg: dict) -> None:
        if "ready" in msg:
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
        elif "exit" in msg:
            box = self._boxes.pop(msg["exit"], None)
            if box is not None:
                status = msg["status"]
                box.finish(os.waitstatus_to_exitcode(status) if status >= 0 else -signal.SIGKILL)
        elif "id" in msg:
            fut = self._replies.pop(msg["id"], None) if msg["id"] is not None else None
            if "pid" in msg:
                msg["box"] = self._boxes[msg["pid"]] = ForkedBox(msg["pid"], template_gone=False)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _gone(self) -> None:
        if self._eof:
            return
        self._eof = True
        if self._chan is not None:
            asyncio.get_running_loop().remove_reader(self._chan.fileno())
        err = TemplateError("the box template exited")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(err)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(err)
        self._replies.clear()
        for box in self._boxes.values():
            box.template_gone()
        self._boxes.clear()

    async def fork(self, plan_path: str, log_fd: int, net: bool) -> ForkedBox:
        """A new box from the plan the farm wrote at ``plan_path``, its output to ``log_fd``."""
        async with self._lock:
            if not self.alive() or self._chan is None:
                raise TemplateError("the box template is not running")
            rid = next(self._ids)
            fut: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
            self._replies[rid] = fut
            msg = json.dumps({"id": rid, "plan": plan_path, "net": net}).encode()
            try:
                socket.send_fds(self._chan, [msg], [log_fd])
            except OSError as e:
                self._replies.pop(rid, None)
                raise TemplateError(f"asking the box template: {e}") from None
            try:
                reply = await asyncio.wait_for(asyncio.shield(fut), REQUEST_TIMEOUT_S)
            except TimeoutError:
                self._replies.pop(rid, None)
                await self.close()  # a template that does not answer is stuck: the next start starts another
                raise TemplateError(f"the box template did not answer in {REQUEST_TIMEOUT_S:.0f} s") from None
        if "error" in reply:
            raise TemplateError(f"the box template could not fork the box: {reply['error']}")
        return reply["box"]

    async def close(self) -> None:
        """Stop the template (its boxes die with it)."""
        if self._chan is not None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(self._chan.fileno())
            self._chan.close()
            self._chan = None
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
        self._gone()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
