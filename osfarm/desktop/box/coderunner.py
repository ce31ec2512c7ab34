"""Python interpreters that run pyautogui code strings, with OSWorld's timing or the fast one.

OSWorld runs every action as ``python -c "import pyautogui; import time; pyautogui.FAILSAFE =
False; <code>"``: a new process per action (its start-up, ~0.3-1 s of imports, comes before the
first input event), pyautogui's default ``PAUSE`` of 0.1 s after every pyautogui call (what lets
an app handle a click before the typing that follows it), and no state kept between actions.
:func:`run_fresh` does exactly that (``timing="osworld"``, the default of the routes that run agent
code). The fast path, :class:`CodeRunner` with ``timing="fast"``, starts one interpreter lazily and
keeps it: ``pyautogui`` and ``time`` are pre-imported, ``PAUSE = 0``, ``FAILSAFE = False``, and
module-level state persists between runs, like a Jupyter kernel; callers wait for the screen to
settle instead of pausing after every call.

Protocol: length-prefixed JSON frames (4-byte big-endian length) on two dedicated pipes passed
to the child with ``pass_fds``; the child's fds 0/1/2 are not used for the protocol, so whatever
user code prints cannot corrupt it. During a run the child points fds 1 and 2 at a fresh file
(so output of ``print``, C extensions and child processes is all captured, interleaved); the file
lives in a per-interpreter temp dir, so even a run that times out returns its partial output.

At start-up the child patches pyautogui's X11 backend so that single characters are pressed with
the keycode and Shift level where the live keymap actually has them. Stock pyautogui looks up
``<`` with ``XKeysymToKeycode`` (the pc105 LSGT key, ``less greater``) but adds Shift because
``<`` is a "shift character" on US keyboards, so ``write('<')`` types ``>``. The patch also lets
``write`` type characters missing from the keymap (``ü``, ``€``) by binding a spare keycode, where
stock pyautogui silently drops them.

Thread-safety: ``run`` calls are serialised with a lock; one runner serves one desktop.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import get_args

from osfarm.desktop.box.agent_world import AgentWorld
from osfarm.schema.guest import ActionTiming, CodeResult

_STARTUP_TIMEOUT_S = 60.0
_MAX_OUTPUT = 1 << 20  # keep the last 1 MiB of a run's output
_MAX_ERROR_LINES = 40

# The child's program, self-contained because it may run on the guest's own python3 (see its docstring).
_KERNEL = (Path(__file__).with_name("code_kernel.py")).read_text(encoding="utf-8")


TIMINGS: tuple[ActionTiming, ...] = get_args(ActionTiming)


class CodeRunner:
    """Runs Python code strings in a persistent interpreter with pyautogui ready to use.

    ``env`` is merged over ``os.environ`` for the interpreter (typically ``{"DISPLAY": ":5"}``);
    ``python`` defaults to ``sys.executable``; ``timing`` sets pyautogui's pause (``"fast"``: 0;
    ``"osworld"``: its default 0.1 s, as in :func:`run_fresh`; ``"settle"``: a zygote that forks a
    child per run, which starts from pyautogui's defaults and nothing else, like ``run_fresh``, and
    waits for the screen to answer each call instead of sleeping; ``settle_source`` is then the
    source of the module with that wait, :mod:`osfarm.desktop.x11.input_settle`, shipped into the
    interpreter, which may be a python that cannot import osfarm). With ``agent`` the interpreter
    runs as the agent's user in its world (:mod:`osfarm.desktop.box.agent_world`): the code is the
    agent's, and everything it sends back (replies, output files) is read as untrusted.
    """

    def __init__(self, env: dict[str, str] | None = None, python: str | None = None,
                 timing: ActionTiming = "fast", agent: AgentWorld | None = None, settle_source: str = ""):
        if timing not in TIMINGS:
            raise ValueError(f"timing must be one of {TIMINGS}, not {timing!r}")
        if timing == "settle" and not settle_source:
            raise ValueError("settle_source: the settle timing needs the source of its wait (input_settle)")
        self._settle_source = settle_source
        self._env = dict(env or {})
        self._timing = timing
        self._python = python or sys.executable
        self._agent = agent
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._req_w = -1
        self._resp_r = -1
        self._outdir = ""
        self._run_id = 0
        self._finalizer: weakref.finalize | None = None

    # ---- process management -------------------------------------------------------------------

    def _start(self) -> str | None:
        """Start the interpreter; returns its start-up error text, or None when it is ready."""
        self._outdir = tempfile.mkdtemp(prefix="osfarm-code-")
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        env = {**os.environ, **self._env}
        # The program goes in a file rather than `-c`, so `ps` shows a short command line.
        kernel_path = os.path.join(self._outdir, "osfarm_kernel.py")
        with open(kernel_path, "w", encoding="utf-8") as f:
            f.write(_KERNEL)
        os.chmod(kernel_path, 0o644)
        if self._settle_source:
            settle_path = os.path.join(self._outdir, "osfarm_input_settle.py")
            with open(settle_path, "w", encoding="utf-8") as f:
                f.write(self._settle_source)
            os.chmod(settle_path, 0o644)
        if self._agent is not None:
            # The agent's interpreter writes its output files here and reads the kernel; it may
            # not list the dir or remove the guest's files (sticky). Opened up only now that
            # the kernel is in place.
            os.chmod(self._outdir, 0o1733)
            env = self._agent.env(env)
        env.update(OSFARM_KERNEL_IO=f"{req_r},{resp_w},{self._outdir}", OSFARM_KERNEL_TIMING=self._timing)
        argv = [self._python, "-u", kernel_path]
        if self._agent is not None:
            argv = self._agent.command(argv, self._agent.home)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(req_r, resp_w), env=env, close_fds=True,
            )
        except OSError as e:
            for fd in (req_r, req_w, resp_r, resp_w):
                os.close(fd)
            shutil.rmtree(self._outdir, ignore_errors=True)
            return f"cannot start {self._python}: {e}"
        os.close(req_r)
        os.close(resp_w)
        self._proc, self._req_w, self._resp_r = proc, req_w, resp_r
        self._finalizer = weakref.finalize(self, _kill, proc, req_w, resp_r, self._outdir)
        try:
            hello = self._recv(time.monotonic() + _STARTUP_TIMEOUT_S)
        except TimeoutError:
            self._stop(kill=True)
            return f"interpreter did not start within {_STARTUP_TIMEOUT_S:.0f} s"
        except EOFError:
            rc = proc.wait()
            self._stop(kill=True)
            return f"interpreter exited during start-up (exit code {rc})"
        if hello.get("error"):
            self._stop(kill=True)
            return "pyautogui set-up failed:\n" + _last_lines(str(hello["error"]))
        return None

    def _stop(self, kill: bool) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        proc = self._proc
        self._proc = None
        if proc is not None:
            _kill(proc, self._req_w, self._resp_r, self._outdir, graceful=not kill)
        self._req_w = self._resp_r = -1

    def _send(self, obj: dict) -> None:
        data = json.dumps(obj).encode("utf-8")
        data = struct.pack(">I", len(data)) + data
        while data:
            data = data[os.write(self._req_w, data) :]

    def _read_exact(self, n: int, deadline: float) -> bytes:
        buf = b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self._resp_r], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(self._resp_r, n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _recv(self, deadline: float) -> dict:
        (n,) = struct.unpack(">I", self._read_exact(4, deadline))
        return json.loads(self._read_exact(n, deadline).decode("utf-8"))

    def _take_output(self, run_id: int) -> str:
        path = os.path.join(self._outdir, f"{run_id}.out")
        try:
            # Written by the interpreter, which may be the agent's: never follow a link, never
            # block on a FIFO, read only the tail of a huge (or sparse) file.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                os.unlink(path)
                return ""
            with os.fdopen(fd, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - _MAX_OUTPUT))
                data = f.read()
            os.unlink(path)
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    # ---- public API -----------------------------------------------------------------------------

    def start(self) -> CodeResult:
        """Start the interpreter now (otherwise the first ``run`` does), e.g. to hide import time."""
        t0 = time.perf_counter()
        with self._lock:
            err = self._start() if self._proc is None else None
        return CodeResult(ok=err is None, error=err, t_ms=(time.perf_counter() - t0) * 1000)

    def run(self, code: str, timeout: float = 30.0) -> CodeResult:
        """Run ``code`` in the session; blocks until it finishes or ``timeout`` seconds pass.

        An exception gives ``ok=False`` with the traceback's last lines in ``error``; on timeout
        the interpreter is killed (the next run starts a fresh one, losing session state).
        """
        return self.run_settled(code, timeout, None)[0]

    def run_settled(self, code: str, timeout: float, owed: object) -> tuple[CodeResult, object]:
        """``run`` for the settle timing: ``owed`` is what the last input event still owes
        (``InputSettle.give_owed``), paid before the code's first event; returns with the result
        what the code's own last event owes, as the agent's side sent it (``InputSettle.take_owed``
        checks it), None when the run failed."""
        t0 = time.perf_counter()
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None:
                self._stop(kill=True)  # died since last time (e.g. user code called os._exit)
            if self._proc is None:
                err = self._start()
                if err is not None:
                    return CodeResult(ok=False, error=err, t_ms=(time.perf_counter() - t0) * 1000), None
            self._run_id += 1
            run_id = self._run_id
            t_run = time.monotonic()
            zygote = self._proc.pid if self._proc is not None else 0
            child: int | None = None  # settle: a pidfd of the child the zygote forked for this code
            answered = False
            try:
                self._send({"id": run_id, "code": code, "owed": owed})
                reply = self._recv(t_run + timeout)
                if "child" in reply:
                    child = _open_child(reply["child"], zygote)
                    reply = self._recv(t_run + timeout)
                answered = True
            except TimeoutError:
                out = self._take_output(run_id)
                self._stop(kill=True)
                return CodeResult(
                    ok=False, output=out, error=f"timed out after {timeout:g} s",
                    t_ms=(time.perf_counter() - t0) * 1000,
                ), None
            except (EOFError, OSError):
                out = self._take_output(run_id)
                proc = self._proc
                rc = proc.wait(timeout=5) if proc is not None else None
                self._stop(kill=True)
                return CodeResult(
                    ok=False, output=out, error=f"interpreter exited (exit code {rc})",
                    t_ms=(time.perf_counter() - t0) * 1000,
                ), None
            finally:
                if child is not None:
                    # The child dies with its zygote, but the code can clear that signal: on a
                    # timeout or a lost zygote the child must not run on after its action.
                    if not answered:
                        _kill_child(child)
                    os.close(child)
            out = self._take_output(run_id)
            err = reply.get("error")
            return CodeResult(
                ok=err is None, output=out, error=_last_lines(err) if err else None,
                t_ms=(time.perf_counter() - t0) * 1000,
            ), reply.get("owed")

    def close(self) -> None:
        """Stop the interpreter (processes it launched keep running)."""
        with self._lock:
            self._stop(kill=False)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None


def run_fresh(code: str, timeout: float = 30.0, env: dict[str, str] | None = None,
              python: str | None = None, agent: AgentWorld | None = None) -> CodeResult:
    """OSWorld's path for one action: a new interpreter for this code alone (its start-up counts,
    as OSWorld's ``python -c`` does), pyautogui's default ``PAUSE``, nothing kept afterwards;
    processes the code launched live on. ``t_ms`` includes the start-up."""
    runner = CodeRunner(env, python, timing="osworld", agent=agent)
    try:
        return runner.run(code, timeout)
    finally:
        runner.close()


def _open_child(pid: object, zygote: int) -> int | None:
    """A pidfd of the settle zygote's child ``pid`` (a number the agent's side sent: taken only
    where that process's parent is the zygote), or None."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            ppid = next((line.split()[1] for line in f if line.startswith("PPid:")), "")
    except OSError:
        ppid = ""
    if ppid != str(zygote):
        os.close(fd)
        return None
    return fd


def _kill_child(pidfd: int) -> None:
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)


def _last_lines(text: str) -> str:
    lines = text.rstrip("\n").splitlines()
    if len(lines) > _MAX_ERROR_LINES:
        lines = ["..."] + lines[-_MAX_ERROR_LINES:]
    return "\n".join(lines)


def _kill(proc: subprocess.Popen[bytes], req_w: int, resp_r: int, outdir: str, graceful: bool = False) -> None:
    # Only the interpreter itself: apps its code launched (subprocess.Popen) are meant to live on.
    if graceful and proc.poll() is None:
        try:
            os.close(req_w)  # EOF on its request pipe makes the kernel loop exit
            req_w = -1
            proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for fd in (req_w, resp_r):
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    shutil.rmtree(outdir, ignore_errors=True)
