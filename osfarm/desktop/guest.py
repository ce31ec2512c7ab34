"""The guest HTTP server that runs inside every desktop (FastAPI).

Two sets of routes, all behind ``Authorization: Bearer <token>``:

* OSWorld-compatible routes (``/screenshot``, ``/execute``, ``/setup/...``): same paths, payloads
  and replies as OSWorld's in-VM Flask server, so its controllers can drive our desktops. Known
  OSWorld bugs are fixed: ``/run_bash_script`` runs once and answers; a command that times out
  answers 200 with ``status: "error"`` and ``returncode: -1`` (OSWorld answers 500, and its
  client then re-runs the side effects three times); ``/setup/open_file`` cannot block forever.
* Native ``/v1`` routes (see :mod:`osfarm.desktop.models`): structured actions through XTest in
  this process, pyautogui code in a long-lived interpreter, one-call observations.

Bad input answers 400 (OSWorld routes) or 422 (``/v1`` bodies) with ``{"detail": "<field>:
<message>"}``; it never answers 500. Every X, AT-SPI and subprocess call is blocking and runs in
a worker thread; the event loop only parses and routes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from osfarm.desktop.models import (
    Window,
)
from osfarm.http.auth import BearerAuth

EXECUTE_TIMEOUT_S = 120.0  # OSWorld's subprocess.run timeout for /execute
RUN_PYTHON_TIMEOUT_S = 30.0
OPEN_FILE_TIMEOUT_S = 120.0  # OSWorld waits up to 1800 s; callers may pass timeout_seconds
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def bad(field: str, message: str, status: int = 400) -> HTTPException:
    return HTTPException(status_code=status, detail=f"{field}: {message}")


# --------------------------------------------------------------------------- request parsing


async def json_object(request: Request) -> dict[str, Any]:
    body = await request.body()
    if not body.strip():
        raise bad("body", "expected a JSON object")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise bad("body", f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad("body", f"expected a JSON object, got {type(data).__name__}")
    return data


def get_str(data: dict[str, Any], name: str, required: bool = True, default: str | None = None) -> str | None:
    if name not in data or data[name] is None:
        if required:
            raise bad(name, "required")
        return default
    v = data[name]
    if not isinstance(v, str):
        raise bad(name, f"expected a string, got {type(v).__name__}")
    if required and not v:
        raise bad(name, "must not be empty")
    return v


def get_bool(data: dict[str, Any], name: str, default: bool) -> bool:
    v = data.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"expected true or false, got {type(v).__name__}")
    return v


def get_num(data: dict[str, Any], name: str, default: float, lo: float = 0.0, hi: float = 3600.0) -> float:
    v = data.get(name, default)
    if v is None:
        return default
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise bad(name, f"expected a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"expected a number, got {type(v).__name__}")
    if not lo < v <= hi:
        raise bad(name, f"must be in ({lo:g}, {hi:g}], got {v:g}")
    return float(v)


def expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def get_command(data: dict[str, Any]) -> tuple[list[str] | str, bool]:
    """OSWorld's {command, shell}: a str is shlex-split unless shell; "~/" args are expanded."""
    shell = get_bool(data, "shell", False)
    if "command" not in data or data["command"] is None:
        raise bad("command", "required (a string or a list of strings)")
    command = data["command"]
    if isinstance(command, str):
        if not command.strip():
            raise bad("command", "must not be empty")
        if not shell:
            try:
                command = shlex.split(command)
            except ValueError as e:
                raise bad("command", f"cannot split into arguments: {e}") from None
    elif isinstance(command, list):
        if not command:
            raise bad("command", "must not be empty")
        for i, arg in enumerate(command):
            if not isinstance(arg, str):
                raise bad(f"command.{i}", f"expected a string, got {type(arg).__name__}")
    else:
        raise bad("command", f"expected a string or a list of strings, got {type(command).__name__}")
    if isinstance(command, list):
        command = [os.path.expanduser(a) if a.startswith("~/") else a for a in command]
    return command, shell


def describe_command(command: list[str] | str) -> str:
    return command if isinstance(command, str) else " ".join(command)


# --------------------------------------------------------------------------- subprocesses


class RunResult:
    def __init__(self, stdout: str, stderr: str, returncode: int, timed_out: bool):
        self.stdout, self.stderr, self.returncode, self.timed_out = stdout, stderr, returncode, timed_out


def run_command(command: list[str] | str, shell: bool, timeout: float, cwd: str | None,
                merge_stderr: bool = False) -> RunResult:
    """Run a command to completion (blocking) with the desktop's environment.

    Unlike ``subprocess.run`` this returns once the command itself exits even when a background
    child it started keeps the output pipes open (``app &``): readers get a short grace period,
    then the partial output is returned. On timeout the whole process group is killed.
    Raises FileNotFoundError / PermissionError when the program cannot be started.
    """
    proc = subprocess.Popen(
        command, shell=shell, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, start_new_session=True,
    )
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    def reader(stream: Any, key: str) -> None:
        # The reader owns its stream and closes it at EOF: closing it from the waiting thread
        # would block on the buffer lock while a background child keeps the pipe open.
        try:
            while True:
                data = stream.read1(65536)
                if not data:
                    break
                chunks[key].append(data)
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    threads = [threading.Thread(target=reader, args=(proc.stdout, "out"), daemon=True)]
    if not merge_stderr:
        threads.append(threading.Thread(target=reader, args=(proc.stderr, "err"), daemon=True))
    for t in threads:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()
    proc.stdout = proc.stderr = None  # owned by the readers now
    for t in threads:
        t.join(0.5)
    decode = lambda key: b"".join(chunks[key]).decode("utf-8", errors="replace")  # noqa: E731
    return RunResult(decode("out"), decode("err"), -1 if timed_out else proc.returncode, timed_out)


def spawn_detached(command: list[str] | str, shell: bool, cwd: str | None) -> subprocess.Popen[bytes]:
    """Start an app and return at once; it stays a descendant of the session (subreaper)."""
    return subprocess.Popen(command, shell=shell, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def directory_tree(path: str, max_entries: int = 200_000) -> dict[str, Any]:
    count = 0

    def walk(p: str) -> dict[str, Any]:
        nonlocal count
        node: dict[str, Any] = {"type": "directory", "name": os.path.basename(p.rstrip("/")) or p, "children": []}
        try:
            entries = sorted(os.scandir(p), key=lambda e: e.name)
        except OSError as e:
            return {"error": str(e)}
        for e in entries:
            count += 1
            if count > max_entries:
                break
            try:
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            node["children"].append(walk(e.path) if is_dir else {"type": "file", "name": e.name})
        return node

    return walk(path)


# --------------------------------------------------------------------------- desktop state


class Desktop:
    """Lazily created per-display helpers shared by all requests (each is thread-safe)."""

    def __init__(self, display: str, home: str, work_dir: Path, alive: Callable[[], bool] | None):
        self.display = display
        self.home = home
        self.work_dir = work_dir
        self._alive = alive
        self.started = time.time()
        self._lock = threading.RLock()  # recorder creation asks for the screen size
        self._capture: Any = None
        self._input: Any = None
        self._runner: Any = None
        self._recorder: Any = None
        self.step_lock = threading.Lock()
        self.wallpaper: str | None = None
        self._a11y_ok = False
        self._a11y_checked = 0.0
        self._a11y_refreshing = False

    def apps_cpu_seconds(self) -> float:
        """CPU seconds used so far by the desktop's processes (the X server, the window manager,
        the apps): this process's descendants. The guest itself is left out, screen grabs and
        all; processes that exited meanwhile drop out, which only makes the desktop look idler."""
        import psutil

        from osfarm.desktop.settle import total_cpu_seconds

        return total_cpu_seconds(psutil.Process().children(recursive=True))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["DISPLAY"] = self.display
        env.setdefault("HOME", self.home)
        env.pop("OSFARM_GUEST_TOKEN", None)
        return env

    @property
    def capture(self) -> Any:
        with self._lock:
            if self._capture is None:
                from osfarm.desktop.capture import ScreenCapture

                self._capture = ScreenCapture(self.display)
            return self._capture

    @property
    def input(self) -> Any:
        with self._lock:
            if self._input is None:
                from osfarm.desktop.xinput import InputController

                self._input = InputController(self.display)
            return self._input

    @property
    def runner(self) -> Any:
        with self._lock:
            if self._runner is None:
                from osfarm.desktop.coderunner import CodeRunner

                self._runner = CodeRunner(env=self.env())
            return self._runner

    @property
    def recorder(self) -> Any:
        with self._lock:
            if self._recorder is None:
                from osfarm.desktop.recording import Recorder

                self._recorder = Recorder(self.display, self.screen_size(), self.work_dir, env=self.env())
            return self._recorder

    def screen_size(self) -> tuple[int, int]:
        return tuple(self.capture.size())  # type: ignore[return-value]

    def x_alive(self) -> bool:
        """Whether the X server still accepts connections."""
        if self._alive is not None and not self._alive():
            return False
        import socket

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
                    from osfarm.desktop.a11y import a11y_bus_ok

                    self._a11y_ok = bool(a11y_bus_ok())
                except Exception:
                    self._a11y_ok = False
                finally:
                    self._a11y_checked = time.monotonic()
                    self._a11y_refreshing = False

            threading.Thread(target=refresh, daemon=True, name="a11y-check").start()
        return self._a11y_ok

    def windows(self) -> list[Window]:
        from osfarm.desktop.windows import list_windows

        return [w if isinstance(w, Window) else Window.model_validate(w, from_attributes=True)
                for w in list_windows(display=self.display)]

    def close(self) -> None:
        for obj in (self._recorder, self._runner, self._input, self._capture):
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass
        try:
            from osfarm.desktop.windows import close_connections

            close_connections()
        except Exception:
            pass


# --------------------------------------------------------------------------- wallpaper


def paint_root(display: str, path: str) -> None:
    """Scale an image over the root window (what feh/hsetroot do), so screenshots show it.

    The pixmap is kept after our connection closes (RetainPermanent) and published in
    _XROOTPMAP_ID like other setters, so compositing apps and panels pick it up.
    """
    from PIL import Image
    from Xlib import X, Xatom
    from Xlib import display as xdisplay

    d = xdisplay.Display(display)
    try:
        screen = d.screen()
        root = screen.root
        w, h = screen.width_in_pixels, screen.height_in_pixels
        with Image.open(path) as src:
            img = src.convert("RGB")
        # cover the screen, cropping the overflow (GNOME's default "zoom")
        ratio = max(w / img.width, h / img.height)
        img = img.resize((max(w, round(img.width * ratio)), max(h, round(img.height * ratio))))
        left, top = (img.width - w) // 2, (img.height - h) // 2
        img = img.crop((left, top, left + w, top + h))
        depth = screen.root_depth
        if depth not in (24, 32):
            return  # 16-bit visuals would need a different pixel packing; leave the root as is
        pix = root.create_pixmap(w, h, depth)
        gc = pix.create_gc()
        data = img.tobytes("raw", "BGRX")
        rows = max(1, 200_000 // (w * 4))  # stay well below the maximum X request size
        for y in range(0, h, rows):
            n = min(rows, h - y)
            pix.put_image(gc, 0, y, w, n, X.ZPixmap, depth, 0, data[y * w * 4:(y + n) * w * 4])
        # Free the pixmap of the previous wallpaper (kept alive by RetainPermanent).
        old = root.get_full_property(d.intern_atom("_XROOTPMAP_ID"), Xatom.PIXMAP)
        if old is not None and old.value and old.value[0] != pix.id:
            try:
                d.kill_client(old.value[0])
            except Exception:
                pass
        for name in ("_XROOTPMAP_ID", "ESETROOT_PMAP_ID"):
            root.change_property(d.intern_atom(name), Xatom.PIXMAP, 32, [pix.id])
        root.change_attributes(background_pixmap=pix)
        root.clear_area(0, 0, w, h)
        d.set_close_down_mode(X.RetainPermanent)
        d.sync()
    finally:
        d.close()


# --------------------------------------------------------------------------- the app


def create_app(
    token: str,
    display: str,
    *,
    home: str | None = None,
    alive: Callable[[], bool] | None = None,
    work_dir: str | None = None,
    warm_code_runner: bool = True,
) -> FastAPI:
    """The guest app for X display ``display``.

    ``alive`` (from the session launcher) says whether Xvfb still runs; ``work_dir`` holds
    recordings and temp scripts; ``home`` is the user's home (default ``$HOME``).
    """
    if not token:
        raise ValueError("a non-empty bearer token is required")
    home = home or os.environ.get("HOME") or str(Path.home())
    wdir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="osfarm-guest-"))
    wdir.mkdir(parents=True, exist_ok=True)
    desk = Desktop(display, home, wdir, alive)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        if warm_code_runner:
            # Hide the interpreter's pyautogui import behind idle time instead of the first step.
            asyncio.get_running_loop().call_later(0.5, lambda: threading.Thread(
                target=_warm, daemon=True, name="warm-code-runner").start())
        yield
        await run_in_threadpool(desk.close)

    def _warm() -> None:
        try:
            desk.runner.start()
        except Exception:
            pass

    app = FastAPI(title="osfarm guest", version="1", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/v1/openapi.json")
    app.state.desktop = desk
    app.add_middleware(BearerAuth, token=token)

    # ---- error shapes

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        err = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
        loc = [str(p) for p in err.get("loc", ())]
        if err.get("type") == "json_invalid":
            return JSONResponse({"detail": f"body: invalid JSON: {err.get('ctx', {}).get('error', err['msg'])}"}, 400)
        if len(loc) > 1 and loc[0] in ("body", "query", "path"):
            loc = loc[1:]
        field = ".".join(loc) or "body"
        return JSONResponse({"detail": f"{field}: {err['msg']}"}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, 500)

    from osfarm.desktop.native_routes import add_native_routes
    from osfarm.desktop.osworld_routes import add_osworld_routes

    add_osworld_routes(app, desk)
    add_native_routes(app, desk)

    return app


__all__ = ["create_app", "run_command"]
