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

import json
import os
import select
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import get_args

from osfarm.desktop.box.agent_world import AgentWorld
from osfarm.schema.guest import ActionTiming, CodeResult

_STARTUP_TIMEOUT_S = 60.0
_MAX_OUTPUT = 1 << 20  # keep the last 1 MiB of a run's output
_MAX_ERROR_LINES = 40

# The child's program. It must run on any Python >= 3.8 with python-xlib + pyautogui (it may be
# the guest's /usr/bin/python3, which cannot import osfarm), so it is self-contained.
_KERNEL = r'''
import ast, json, linecache, os, struct, sys, traceback

sys.path[0] = ""  # like `python -c`: the working directory, not this file's temp dir

_rfd, _wfd, _outdir = os.environ.pop("OSFARM_KERNEL_IO").split(",", 2)
_rfd, _wfd = int(_rfd), int(_wfd)
# "osworld": pyautogui's defaults (PAUSE = 0.1 s after each call); "fast": PAUSE = 0
_timing = os.environ.pop("OSFARM_KERNEL_TIMING", "fast")


def _read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(_rfd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _recv():
    (n,) = struct.unpack(">I", _read_exact(4))
    return json.loads(_read_exact(n).decode("utf-8"))


def _send(obj):
    data = json.dumps(obj).encode("utf-8")
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(_wfd, data):]


def _char_keysym(ch):
    special = {"\n": 0xFF0D, "\r": 0xFF0D, "\t": 0xFF09, "\b": 0xFF08}
    if ch in special:
        return special[ch]
    cp = ord(ch)
    if cp < 0x20 or 0x7F <= cp < 0xA0:
        return None
    return cp if cp < 0x100 else 0x01000000 | cp


def _patch_pyautogui_x11(pyautogui):
    """Press single characters where the live keymap has them (see the module docstring)."""
    x11 = getattr(pyautogui, "platformModule", None)
    if x11 is None or not hasattr(x11, "keyboardMapping") or not hasattr(x11, "_display"):
        return
    from Xlib import X
    from Xlib.ext.xtest import fake_input
    from Xlib.protocol import event as xevent

    d = x11._display
    orig_down, orig_up = x11._keyDown, x11._keyUp
    bound = {}  # spare keycode -> keysym we bound

    def refresh():
        # pyautogui never reads events, so its keymap cache goes stale when someone remaps.
        for _ in range(d.pending_events()):
            ev = d.next_event()
            if isinstance(ev, xevent.MappingNotify):
                d.refresh_keyboard_mapping(ev)

    def shift_code():
        return d.keysym_to_keycode(0xFFE1)  # Shift_L

    def bind_spare(ks):
        info = d.display.info
        first = info.min_keycode + 1
        rows = d.get_keyboard_mapping(first, info.max_keycode - first + 1)
        spare = [first + i for i, r in enumerate(rows) if not any(r)]
        if spare:
            code = spare[-1]
        elif bound:
            code = next(iter(bound))
            del bound[code]
        else:
            return 0
        d.change_keyboard_mapping(code, [(ks, ks)])
        d.sync()
        d._update_keymap(code, 1)
        bound[code] = ks
        return code

    def resolve(ch):
        ks = _char_keysym(ch)
        if ks is None:
            return 0, False
        refresh()
        for code, level in d.keysym_to_keycodes(ks):
            if level in (0, 1):
                return code, level == 1
        return bind_spare(ks), False

    def key_down(key):
        if isinstance(key, str) and len(key) == 1:
            code, shift = resolve(key)
            if code:
                if shift:
                    fake_input(d, X.KeyPress, shift_code())
                fake_input(d, X.KeyPress, code)
                if shift:
                    fake_input(d, X.KeyRelease, shift_code())
                d.sync()
                return
        orig_down(key)

    def key_up(key):
        if isinstance(key, str) and len(key) == 1:
            code, _shift = resolve(key)
            if code:
                fake_input(d, X.KeyRelease, code)
                d.sync()
                return
        orig_up(key)

    x11._keyDown, x11._keyUp = key_down, key_up


_ns = {"__name__": "__main__", "__builtins__": __builtins__}
_settle = None  # "settle": the module with InputSettle, shipped next to this file
_spare = None  # "settle": X connections opened for the next forked child
_boot_error = None
try:
    exec("import time\nimport pyautogui\n" + ("pyautogui.PAUSE = 0\n" if _timing == "fast" else "")
         + "pyautogui.FAILSAFE = False\n", _ns)
    if _timing == "settle":
        # A zygote: everything imported once, each action in a forked child (see _run_forked).
        # The child patches pyautogui on its own X connection, so the zygote does not here.
        import importlib.util
        _spec = importlib.util.spec_from_file_location(
            "osfarm_input_settle", os.path.join(os.path.dirname(os.path.abspath(__file__)), "osfarm_input_settle.py"))
        _settle = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_settle)
        from Xlib import display as _xdisplay
    else:
        _patch_pyautogui_x11(_ns["pyautogui"])
except BaseException:
    _boot_error = traceback.format_exc()
_send({"ready": True, "error": _boot_error})


def _die_with_zygote(zygote):
    """The guest kills the zygote on a timeout: its child running the code must go with it."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except Exception:
        pass
    if os.getppid() != zygote:  # it died before the prctl took
        os._exit(1)


def _settled_child(run_id, code, zygote):
    """In the forked child: OSWorld's fresh start for this code (pyautogui's defaults, globals
    holding only pyautogui and time, as `python -c "import pyautogui; import time; ..."`), with
    pyautogui's sleep of PAUSE after each call replaced by the settle wait (capped at PAUSE)."""
    os.close(_rfd)
    os.close(_wfd)
    _die_with_zygote(zygote)
    pyautogui = _ns["pyautogui"]
    x11 = getattr(pyautogui, "platformModule", None)
    conn, settle = _spare if _spare is not None else _connect()
    settle.arm()  # what was drawn before this action is not its answer
    if x11 is not None and hasattr(x11, "_display"):
        # Not the zygote's own connection: its request sequence numbers went stale with every
        # earlier child, so replies would be matched to the wrong requests.
        x11._display = conn
    _patch_pyautogui_x11(pyautogui)
    default_pause, sleep_pause = pyautogui.PAUSE, pyautogui._handlePause
    focus = [False]  # whether the call being paused after may move the focus (input_settle.focus_key)

    def flag(fn, when):
        def flagged(*args, **kwargs):
            if when(*args):
                focus[0] = True
            return fn(*args, **kwargs)
        return flagged

    if x11 is not None:
        for name in ("_mouseDown", "_mouseUp", "_click"):
            if hasattr(x11, name):
                setattr(x11, name, flag(getattr(x11, name), lambda *a: True))
        if hasattr(x11, "_keyDown"):
            x11._keyDown = flag(x11._keyDown, lambda key, *a: isinstance(key, str) and _settle.focus_key(key))

    def settled_pause(_pause):
        focus_may_move, focus[0] = focus[0], False
        if _pause and pyautogui.PAUSE == default_pause:
            settle.wait(default_pause, focus_may_move)
        else:  # the code set its own PAUSE: it gets the sleep it asked for, as under OSWorld
            sleep_pause(_pause)

    pyautogui._handlePause = settled_pause
    return _run(run_id, code, {"__name__": "__main__", "__builtins__": __builtins__,
                               "pyautogui": pyautogui, "time": _ns["time"]})


def _connect():
    return _xdisplay.Display(os.environ["DISPLAY"]), _settle.InputSettle(os.environ["DISPLAY"])


def _prepare_spare():
    """Open the next child's two X connections now, between actions: connecting (python-xlib asks
    the server about every extension) is most of a child's start-up otherwise."""
    global _spare
    try:
        _spare = _connect()
    except Exception:
        _spare = None  # the child connects itself, and reports what fails


def _run_forked(run_id, code):
    """Run ``code`` in a child forked from this zygote; its error text (None: it ran)."""
    global _spare
    d = getattr(getattr(_ns["pyautogui"], "platformModule", None), "_display", None)
    if d is not None:  # the zygote never reads its connection: drop what the server queued on it
        for _ in range(d.pending_events()):
            d.next_event()
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            err = _settled_child(run_id, code, zygote)
        except BaseException:
            err = traceback.format_exc()
        try:
            # at most ~60 KB of JSON, under a pipe's buffer: the write never blocks
            os.write(w, json.dumps(err if err is None else err[-10000:]).encode("utf-8"))
        finally:
            os._exit(0)
    os.close(w)
    if _spare is not None:  # the child's now: let go of this process's end, telling the server nothing
        _spare[0].display.socket.close()
        _spare[1].forget()
        _spare = None
    _, status = os.waitpid(pid, 0)
    os.set_blocking(r, False)
    data = b""
    try:
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:  # a process the code started holds the pipe open: we have it all
        pass
    os.close(r)
    if not data:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        return "code process exited (exit code %d)" % code
    return json.loads(data.decode("utf-8"))


def _run(run_id, code, ns):
    name = "<code-%d>" % run_id
    path = os.path.join(_outdir, "%d.out" % run_id)
    out_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # the guest reads it
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    error = None
    try:
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        tree = ast.parse(code, name, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            # Like a notebook cell: echo the value of a trailing expression.
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), ns)
        if last is not None:
            value = eval(compile(last, name, "eval"), ns)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        if e.code not in (None, 0):
            error = "SystemExit: %r" % (e.code,)
    except BaseException as e:
        tb = e.__traceback__
        # Drop this kernel's own frame so the traceback starts in the user's code.
        if tb is not None and tb.tb_frame.f_code is _run.__code__:
            tb = tb.tb_next
        error = "".join(traceback.format_exception(type(e), e, tb))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return error


if _timing == "settle" and _boot_error is None:
    _prepare_spare()
while True:
    try:
        req = _recv()
    except EOFError:
        break
    if _timing == "settle":
        err = _run_forked(req["id"], req["code"])
    else:
        err = _run(req["id"], req["code"], _ns)
    _send({"id": req["id"], "error": err})
    if _timing == "settle" and _boot_error is None:
        _prepare_spare()
'''


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
        t0 = time.perf_counter()
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None:
                self._stop(kill=True)  # died since last time (e.g. user code called os._exit)
            if self._proc is None:
                err = self._start()
                if err is not None:
                    return CodeResult(ok=False, error=err, t_ms=(time.perf_counter() - t0) * 1000)
            self._run_id += 1
            run_id = self._run_id
            t_run = time.monotonic()
            try:
                self._send({"id": run_id, "code": code})
                reply = self._recv(t_run + timeout)
            except TimeoutError:
                out = self._take_output(run_id)
                self._stop(kill=True)
                return CodeResult(
                    ok=False, output=out, error=f"timed out after {timeout:g} s",
                    t_ms=(time.perf_counter() - t0) * 1000,
                )
            except (EOFError, OSError):
                out = self._take_output(run_id)
                proc = self._proc
                rc = proc.wait(timeout=5) if proc is not None else None
                self._stop(kill=True)
                return CodeResult(
                    ok=False, output=out, error=f"interpreter exited (exit code {rc})",
                    t_ms=(time.perf_counter() - t0) * 1000,
                )
            out = self._take_output(run_id)
            err = reply.get("error")
            return CodeResult(
                ok=err is None, output=out, error=_last_lines(err) if err else None,
                t_ms=(time.perf_counter() - t0) * 1000,
            )

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
