"""What every route of one guest server shares: the :class:`Desktop` (its display, home, and the
screen-capture, input, code-runner and recorder objects made on first use), and the FastAPI
dependency that hands it to a route (``desk: DesktopDep``)."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Generic, Protocol, TypeVar

import psutil
from fastapi import Depends, Request

from osfarm.desktop.box.agent_files import AGENT_PYTHON, AgentFileError, AgentFiles
from osfarm.desktop.box.agent_world import AgentWorld
from osfarm.desktop.box.coderunner import CodeRunner, run_fresh
from osfarm.desktop.session.a11y_bus import a11y_bus_ok
from osfarm.desktop.x11 import input_settle
from osfarm.desktop.x11.capture import ScreenCapture
from osfarm.desktop.x11.input_settle import InputSettle
from osfarm.desktop.x11.recording import Recorder
from osfarm.desktop.x11.settle import total_cpu_seconds
from osfarm.desktop.x11.windows import close_connections, list_windows
from osfarm.desktop.x11.xinput import InputController
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, CodeResult
from osfarm.schema.observation import Window

# How long runner_pid waits for a background start (the interpreter's own start-up limit, and some).
_RUNNER_SETTLE_S = 70.0


class _Closeable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=_Closeable)


class _OnFirstUse(Generic[T]):
    """An object made the first time it is asked for (under the desktop's lock): most requests
    need only some of them, and each one holds an X connection or a process."""

    def __init__(self, make: Callable[[], T], lock: threading.RLock):
        self._make = make
        self._lock = lock
        self._obj: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._obj is None:
                self._obj = self._make()
            return self._obj

    def close(self) -> None:
        if self._obj is not None:
            try:
                self._obj.close()
            except Exception:
                pass


class Desktop:
    """Per-display helpers shared by all requests (each is thread-safe)."""

    def __init__(self, display: str, home: str, work_dir: Path, alive: Callable[[], bool] | None,
                 agent: AgentWorld | None = None):
        self.display = display
        self.home = home
        self.work_dir = work_dir
        # In a box, what is done for the agent runs as the agent (osfarm.desktop.box.agent_world):
        # its code, commands, apps and file operations; ``files`` does the file routes' work.
        self.agent = agent
        self.session = "light"  # the desktop session (osfarm.desktop.session.gnome.DESKTOPS)
        self.code_python = AGENT_PYTHON if agent is not None else None
        self.exchange_dir = ""
        self.files: AgentFiles | None = None
        if agent is not None:
            # Scripts the guest hands to the agent's side (readable, not listable, sticky).
            self.exchange_dir = tempfile.mkdtemp(prefix="osfarm-guest-")
            self.files = AgentFiles(agent, agent.env(dict(os.environ)), self.exchange_dir)
            os.chmod(self.exchange_dir, 0o1733)  # opened up once the helper script is in place
        self._alive = alive
        self.started = time.time()
        self._lock = threading.RLock()  # recorder creation asks for the screen size
        self._capture = _OnFirstUse(lambda: ScreenCapture(self.display), self._lock)
        self._input = _OnFirstUse(lambda: InputController(self.display), self._lock)
        self._runner = _OnFirstUse(
            lambda: CodeRunner(env=self.env(), python=self.code_python, agent=self.agent), self._lock)
        self._settle_runner = _OnFirstUse(self._new_settle_runner, self._lock)
        self._input_settle = _OnFirstUse(lambda: InputSettle(self.display), self._lock)
        self._recorder = _OnFirstUse(
            lambda: Recorder(self.display, self.screen_size(), self.work_dir, env=self.env()), self._lock)
        self.step_lock = threading.Lock()
        # Clear while a background start of the interpreter is under way (see runner_pid).
        self._runner_settled = threading.Event()
        self._runner_settled.set()
        self.wallpaper: str | None = None
        self.warm_baseline: Any = None  # osfarm.desktop.warm.warm.Baseline, once the farm asked for warm resets
        # the session's, for warm resets (ms per step)
        self.restart_buses: Callable[[], dict[str, float] | None] | None = None
        self._a11y_ok = False
        self._a11y_checked = 0.0
        self._a11y_refreshing = False

    @property
    def capture(self) -> ScreenCapture:
        return self._capture.get()

    @property
    def input(self) -> InputController:
        return self._input.get()

    @property
    def runner(self) -> CodeRunner:
        return self._runner.get()

    @property
    def settle_runner(self) -> CodeRunner:
        """The ``settle`` timing's zygote (OSWorld's semantics per code action, forked)."""
        return self._settle_runner.get()

    @property
    def input_settle(self) -> InputSettle:
        """The ``settle`` timing's wait after a computer_13 action."""
        return self._input_settle.get()

    def _prestarted(self) -> _OnFirstUse[CodeRunner]:
        # the default timing's runner is the one the next step most likely needs; osworld's
        # python -c has nothing to start ahead, so it keeps the kept interpreter warm
        return self._settle_runner if DEFAULT_ACTION_TIMING == "settle" else self._runner

    @property
    def prestarted_runner(self) -> CodeRunner:
        """The code runner started ahead of the first step (:meth:`restart_runner`): the default
        action timing's (settle's zygote); the others start on their first use."""
        return self._prestarted().get()

    def _new_settle_runner(self) -> CodeRunner:
        return CodeRunner(env=self.env(), python=self.code_python, agent=self.agent, timing="settle",
                          settle_source=Path(input_settle.__file__).read_text(encoding="utf-8"))

    @property
    def recorder(self) -> Recorder:
        return self._recorder.get()

    def reset_helpers(self) -> None:
        """Stop the interpreter, the recorder and the input controller (a warm reset); each is
        made again on its next use."""
        with self._lock:
            for obj in (self._recorder, self._runner, self._settle_runner, self._input_settle, self._input):
                obj.close()
            self._runner = _OnFirstUse(
                lambda: CodeRunner(env=self.env(), python=self.code_python, agent=self.agent), self._lock)
            self._settle_runner = _OnFirstUse(self._new_settle_runner, self._lock)
            self._input_settle = _OnFirstUse(lambda: InputSettle(self.display), self._lock)
            self._recorder = _OnFirstUse(
                lambda: Recorder(self.display, self.screen_size(), self.work_dir, env=self.env()), self._lock)
            self._input = _OnFirstUse(lambda: InputController(self.display), self._lock)

    def runner_pid(self) -> int | None:
        """The interpreter's pid, once a start in the background is over: its start-up runs agent
        processes of its own (pyautogui's import asks `which gnome-screenshot`), which a
        fingerprint taken meanwhile would count as the agent's."""
        self._runner_settled.wait(timeout=_RUNNER_SETTLE_S)
        obj = self._prestarted()._obj
        return obj.pid if obj is not None else None

    def restart_runner(self, delay: float = 0.0) -> None:
        """Start the interpreter in the background (after ``delay`` seconds), as the cold start
        does, to hide its import behind idle time instead of the first step."""
        self._runner_settled.clear()

        def go() -> None:
            try:
                if delay:
                    time.sleep(delay)
                with contextlib.suppress(Exception):
                    self.prestarted_runner.start()
            finally:
                self._runner_settled.set()

        threading.Thread(target=go, daemon=True, name="warm-code-runner").start()

    def apps_cpu_seconds(self) -> float:
        """CPU seconds used so far by the desktop's processes (the X server, the window manager,
        the apps): this process's descendants. The guest itself is left out, screen grabs and
        all; processes that exited meanwhile drop out, which only makes the desktop look idler."""
        return total_cpu_seconds(psutil.Process().children(recursive=True))

    def script_path(self, name: str, text: str) -> Path:
        """A script the routes run (``/run_python``, ``/run_bash_script``), where whoever runs
        it can read it: the exchange dir in a box, else the work dir."""
        path = Path(self.exchange_dir or self.work_dir) / name
        # The exchange dir is writable by the agent: never follow or reuse what it may have put there.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def _stat(self, path: str) -> dict[str, object] | None:
        """What the agent's side sees at ``path`` (None: nothing it can reach)."""
        assert self.files is not None
        try:
            return self.files.stat(path)
        except AgentFileError:
            return None

    def exists(self, path: str) -> bool:
        return self._stat(path) is not None if self.files is not None else os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        if self.files is None:
            return os.path.isdir(path)
        st = self._stat(path)
        return bool(st and st.get("dir"))

    def is_file(self, path: str) -> bool:
        if self.files is None:
            return os.path.isfile(path)
        st = self._stat(path)
        return bool(st and st.get("file"))

    def run_fresh(self, code: str, timeout: float) -> CodeResult:
        """OSWorld's one-interpreter-per-action path (:func:`osfarm.desktop.box.coderunner.run_fresh`)."""
        return run_fresh(code, timeout, env=self.env(), python=self.code_python, agent=self.agent)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["DISPLAY"] = self.display
        env.setdefault("HOME", self.home)
        env.pop("OSFARM_GUEST_TOKEN", None)
        return env

    def screen_size(self) -> tuple[int, int]:
        return self.capture.size()

    def x_alive(self) -> bool:
        """Whether the X server still accepts connections."""
        if self._alive is not None and not self._alive():
            return False
        num = self.display.lstrip(":").split(".")[0]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            for addr in (f"\0/tmp/.X11-unix/X{num}", f"/tmp/.X11-unix/X{num}"):
                try:
                    s.connect(addr)
                    return True
                except OSError:
                    continue
            return False
        finally:
            s.close()

    def a11y_ok(self) -> bool:
        """Cached AT-SPI bus check, refreshed in the background (health must stay fast)."""
        now = time.monotonic()
        if now - self._a11y_checked > 5.0 and not self._a11y_refreshing:
            self._a11y_refreshing = True

            def refresh() -> None:
                try:
                    self._a11y_ok = bool(a11y_bus_ok())
                except Exception:
                    self._a11y_ok = False
                finally:
                    self._a11y_checked = time.monotonic()
                    self._a11y_refreshing = False

            threading.Thread(target=refresh, daemon=True, name="a11y-check").start()
        return self._a11y_ok

    def windows(self) -> list[Window]:
        return list_windows(display=self.display)

    def close(self) -> None:
        for obj in (self._recorder, self._runner, self._settle_runner, self._input_settle, self._input, self._capture):
            obj.close()
        try:
            close_connections()
        except Exception:
            pass


def get_desktop(request: Request) -> Desktop:
    desk: Desktop = request.app.state.desktop
    return desk


# What a route declares to get the desktop: ``async def route(desk: DesktopDep)``.
DesktopDep = Annotated[Desktop, Depends(get_desktop)]
