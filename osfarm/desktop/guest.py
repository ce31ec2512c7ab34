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
import base64
import hmac
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from osfarm.desktop.actions import (
    ActionError,
    CodeAction,
    check_on_screen,
    is_terminal,
    parse_action,
)
from osfarm.desktop.models import (
    ActionResult,
    CodeRequest,
    CodeResult,
    Health,
    ImageFormat,
    ObserveOptions,
    Observation,
    ScreenSize,
    StepRequest,
    StepResult,
    WaitForFile,
    WaitForWindow,
    WaitResult,
    Window,
)

EXECUTE_TIMEOUT_S = 120.0  # OSWorld's subprocess.run timeout for /execute
RUN_PYTHON_TIMEOUT_S = 30.0
OPEN_FILE_TIMEOUT_S = 120.0  # OSWorld waits up to 1800 s; callers may pass timeout_seconds
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def bad(field: str, message: str, status: int = 400) -> HTTPException:
    return HTTPException(status_code=status, detail=f"{field}: {message}")


# --------------------------------------------------------------------------- auth


class BearerAuth:
    """Pure ASGI middleware: every HTTP request needs the bearer token, unknown paths included."""

    def __init__(self, app: Any, token: str):
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                header = v
                break
        scheme, _, given = header.partition(b" ")
        if not header:
            msg = "missing bearer token: send 'Authorization: Bearer <token>'"
        elif scheme.lower() != b"bearer":
            msg = "unsupported authorization scheme: use 'Authorization: Bearer <token>'"
        elif not hmac.compare_digest(given.strip(), self.token):
            msg = "invalid bearer token"
        else:
            return await self.app(scope, receive, send)
        body = json.dumps({"detail": msg}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})


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

    # ==================================================================== OSWorld routes

    async def _execute(request: Request) -> JSONResponse:
        data = await json_object(request)
        command, shell = get_command(data)
        timeout = get_num(data, "timeout", EXECUTE_TIMEOUT_S)
        try:
            r = await run_in_threadpool(run_command, command, shell, timeout, desk.home)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            raise bad("command", f"cannot run {describe_command(command)!r}: {e.strerror or e}") from None
        reply: dict[str, Any] = {"status": "success", "output": r.stdout, "error": r.stderr, "returncode": r.returncode}
        if r.timed_out:
            # 200, not OSWorld's 500: its client would re-run the command three times.
            reply.update(status="error", message=f"command timed out after {timeout:g} s")
        return JSONResponse(reply)

    app.post("/execute")(_execute)
    app.post("/setup/execute")(_execute)

    async def _execute_verified(request: Request) -> JSONResponse:
        data = await json_object(request)
        command, shell = get_command(data)
        verification = data.get("verification") or {}
        if not isinstance(verification, dict):
            raise bad("verification", f"expected an object, got {type(verification).__name__}")
        window_exists = get_str(verification, "window_exists", required=False)
        command_success = get_str(verification, "command_success", required=False)
        max_wait = get_num(data, "max_wait_time", 10.0)
        interval = get_num(data, "check_interval", 1.0, hi=60.0)

        def work() -> tuple[dict[str, Any], int]:
            r = run_command(command, shell, EXECUTE_TIMEOUT_S, desk.home)
            base = {"output": r.stdout, "error": r.stderr, "returncode": r.returncode}
            if r.timed_out:
                return {"status": "error", "message": "command timed out", **base}, 200
            if not verification:
                return {"status": "success", **base}, 200
            t0 = time.monotonic()
            while True:
                ok = True
                if window_exists:
                    titles = [w.title.lower() for w in desk.windows()]
                    ok = any(window_exists.lower() in t for t in titles)
                if ok and command_success:
                    ok = run_command(command_success, True, 5.0, desk.home).returncode == 0
                waited = time.monotonic() - t0
                if ok:
                    return {"status": "success", **base, "verification": "passed", "wait_time": waited}, 200
                if waited + interval > max_wait:
                    return {"status": "verification_failed", **base, "verification": "failed",
                            "wait_time": waited}, 500
                time.sleep(interval)

        try:
            reply, status = await run_in_threadpool(work)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            raise bad("command", f"cannot run {describe_command(command)!r}: {e.strerror or e}") from None
        return JSONResponse(reply, status)

    app.post("/execute_with_verification")(_execute_verified)
    app.post("/setup/execute_with_verification")(_execute_verified)

    @app.post("/setup/launch")
    async def launch(request: Request) -> PlainTextResponse:
        data = await json_object(request)
        command, shell = get_command(data)
        try:
            await run_in_threadpool(spawn_detached, command, shell, desk.home)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            raise bad("command", f"cannot launch {describe_command(command)!r}: {e.strerror or e}") from None
        return PlainTextResponse(f"{describe_command(command)} launched successfully")

    @app.get("/screenshot")
    async def screenshot() -> Response:
        from osfarm.desktop.capture import encode_image

        def work() -> bytes:
            # OSWorld saves with Pillow's default zlib level (6); the compatible route keeps
            # that so it behaves like OSWorld's. /v1/screenshot is the fast path.
            return encode_image(desk.capture.grab(cursor=True), "png", png_level=6)

        return Response(await run_in_threadpool(work), media_type="image/png")

    @app.get("/accessibility")
    async def accessibility() -> JSONResponse:
        def work() -> str:
            from osfarm.desktop.a11y import accessibility_tree

            return accessibility_tree()

        try:
            xml = await run_in_threadpool(work)
        except ImportError as e:
            raise HTTPException(503, f"accessibility: not available: {e}") from None
        return JSONResponse({"AT": xml})

    @app.get("/terminal")
    async def terminal() -> JSONResponse:
        def work() -> str | None:
            from osfarm.desktop.a11y import terminal_text

            return terminal_text()

        try:
            text = await run_in_threadpool(work)
        except ImportError as e:
            raise HTTPException(503, f"terminal: not available: {e}") from None
        return JSONResponse({"output": text, "status": "success"})

    @app.post("/screen_size")
    async def screen_size() -> JSONResponse:
        w, h = await run_in_threadpool(desk.screen_size)
        return JSONResponse({"width": w, "height": h})

    @app.post("/window_size")
    async def window_size(request: Request) -> JSONResponse:
        form = await request.form()
        name = form.get("app_class_name")
        if not isinstance(name, str) or not name:
            raise bad("app_class_name", "required (form field)")
        from osfarm.desktop.windows import window_size as wsize

        size = await run_in_threadpool(lambda: wsize(name, display=desk.display))
        if size is None:
            raise bad("app_class_name", f"no window with WM_CLASS {name!r}", 404)
        return JSONResponse({"width": size[0], "height": size[1]})

    @app.get("/cursor_position")
    async def cursor_position() -> JSONResponse:
        x, y = await run_in_threadpool(lambda: desk.input.cursor_position())
        return JSONResponse([x, y])

    @app.get("/platform")
    async def get_platform() -> PlainTextResponse:
        return PlainTextResponse(platform.system())

    @app.post("/desktop_path")
    async def desktop_path() -> JSONResponse:
        path = os.path.join(desk.home, "Desktop")
        if not os.path.isdir(path):
            return JSONResponse({"error": "desktop path not found", "detail": f"desktop_path: {path} does not exist"}, 404)
        return JSONResponse({"desktop_path": path})

    @app.post("/wallpaper")
    async def wallpaper() -> Response:
        path = desk.wallpaper
        if not path or not os.path.isfile(path):
            return JSONResponse({"detail": "wallpaper: no wallpaper set"}, 404)
        return FileResponse(path, media_type="image/png")

    @app.post("/setup/change_wallpaper")
    async def change_wallpaper(request: Request) -> PlainTextResponse:
        data = await json_object(request)
        raw = get_str(data, "path")
        assert raw is not None
        path = Path(expand(raw))
        if not path.is_file():
            raise bad("path", f"file not found: {path}", 404)
        try:
            await run_in_threadpool(paint_root, desk.display, str(path))
        except OSError as e:  # PIL cannot read it
            raise bad("path", f"not an image: {e}") from None
        desk.wallpaper = str(path)
        return PlainTextResponse("Wallpaper changed successfully")

    @app.post("/list_directory")
    async def list_directory(request: Request) -> JSONResponse:
        data = await json_object(request)
        raw = get_str(data, "path")
        assert raw is not None
        path = expand(raw)
        if not os.path.isdir(path):
            raise bad("path", f"not a directory: {path}")
        return JSONResponse({"directory_tree": await run_in_threadpool(directory_tree, path)})

    @app.post("/file")
    async def get_file(request: Request) -> Response:
        form = await request.form()
        raw = form.get("file_path")
        if not isinstance(raw, str) or not raw:
            raise bad("file_path", "required (form field)")
        path = expand(raw)
        if os.path.isdir(path):
            raise bad("file_path", f"is a directory: {path}")
        if not os.path.isfile(path):
            return JSONResponse({"error": "File not found", "detail": f"file_path: file not found: {path}"}, 404)
        return FileResponse(path, filename=os.path.basename(path), content_disposition_type="attachment")

    @app.post("/setup/upload")
    async def upload(request: Request) -> PlainTextResponse:
        form = await request.form()
        raw = form.get("file_path")
        up = form.get("file_data")
        if not isinstance(raw, str) or not raw:
            raise bad("file_path", "required (form field)")
        if up is None:
            raise bad("file_data", "required (multipart file part)")
        if not isinstance(up, UploadFile):
            raise bad("file_data", "expected a file part, got a plain form field")
        path = expand(raw)

        def save() -> int:
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            tmp = f"{path}.part-{os.getpid()}-{threading.get_ident()}"
            try:
                with open(tmp, "wb") as f:
                    shutil.copyfileobj(up.file, f, 1 << 20)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return os.path.getsize(path)

        try:
            size = await run_in_threadpool(save)
        except (IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError) as e:
            raise bad("file_path", f"cannot write {path}: {e.strerror or e}") from None
        return PlainTextResponse(f"File Uploaded: {size} bytes")

    @app.post("/setup/open_file")
    async def open_file(request: Request) -> PlainTextResponse:
        data = await json_object(request)
        raw = get_str(data, "path")
        assert raw is not None
        window_name = get_str(data, "window_name", required=False)
        timeout = get_num(data, "timeout_seconds", OPEN_FILE_TIMEOUT_S, hi=1800.0)
        path = Path(expand(raw))
        if path.exists():
            opener = "xdg-open"
            if shutil.which(opener) is None:
                raise HTTPException(503, "path: xdg-open is not installed in this desktop")
            command = [opener, str(path)]
            candidates = [path.name, path.stem]
        else:
            exe = shutil.which(raw)
            if exe is None:
                raise bad("path", f"application/file not found: {raw}", 404)
            command = [exe]
            candidates = [raw]
        if window_name:
            candidates = [window_name]
        candidates = [c for c in candidates if c]

        def work() -> str | None:
            from osfarm.desktop.windows import activate_window

            spawn_detached(command, False, desk.home)
            deadline = time.monotonic() + timeout
            while True:
                for w in desk.windows():
                    if any(c in w.title for c in candidates):
                        activate_window(w.title, strict=True, display=desk.display)
                        return w.title
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.1)

        title = await run_in_threadpool(work)
        if title is None:
            raise HTTPException(504, f"path: no window titled like {candidates} within {timeout:g} s")
        return PlainTextResponse("File opened and window activated successfully")

    def _window_op(op: str) -> Callable[[Request], Any]:
        async def handler(request: Request) -> PlainTextResponse:
            data = await json_object(request)
            name = get_str(data, "window_name")
            strict = get_bool(data, "strict", False)
            by_class = get_bool(data, "by_class", False)
            from osfarm.desktop import windows as wmod

            fn = wmod.activate_window if op == "activate" else wmod.close_window
            found = await run_in_threadpool(lambda: fn(name, strict=strict, by_class=by_class, display=desk.display))
            if not found:
                raise bad("window_name", f"window {name!r} not found", 404)
            return PlainTextResponse("Window activated successfully" if op == "activate" else "Window closed successfully.")

        return handler

    app.post("/setup/activate_window")(_window_op("activate"))
    app.post("/setup/close_window")(_window_op("close"))

    @app.post("/run_python")
    async def run_python(request: Request) -> JSONResponse:
        data = await json_object(request)
        code = get_str(data, "code")
        assert code is not None
        script = desk.work_dir / f"python_exec_{os.getpid()}_{time.monotonic_ns()}.py"
        script.write_text(code)
        try:
            r = await run_in_threadpool(run_command, [sys.executable, str(script)], False,
                                        RUN_PYTHON_TIMEOUT_S, desk.home)
        finally:
            script.unlink(missing_ok=True)
        if r.timed_out:
            return JSONResponse({"status": "error", "message": "Execution timeout: Code took too long to execute",
                                 "need_more": False, "output": r.stdout, "error": "TimeoutExpired",
                                 "return_code": -1})
        error = r.stderr
        if r.returncode != 0 and not error:
            error = f"Process exited with code {r.returncode}"
        message = r.stdout + (("\n" if r.stdout else "") + error if error else "")
        return JSONResponse({"status": "success" if r.returncode == 0 else "error", "message": message,
                             "need_more": False, "output": r.stdout, "error": error,
                             "return_code": r.returncode})

    @app.post("/run_bash_script")
    async def run_bash_script(request: Request) -> JSONResponse:
        data = await json_object(request)
        script = get_str(data, "script")
        assert script is not None
        timeout = get_num(data, "timeout", 100.0)
        wd = get_str(data, "working_dir", required=False)
        cwd = expand(wd) if wd else desk.home
        if not os.path.isdir(cwd):
            raise bad("working_dir", f"not a directory: {cwd}")
        if "#!/bin/bash" not in script:
            script = "#!/bin/bash\n\n" + script
        path = desk.work_dir / f"bash_{os.getpid()}_{time.monotonic_ns()}.sh"
        path.write_text(script)
        try:
            r = await run_in_threadpool(run_command, ["/bin/bash", str(path)], False, timeout, cwd, True)
        finally:
            path.unlink(missing_ok=True)
        if r.timed_out:
            return JSONResponse({"status": "error", "output": r.stdout + f"\nScript execution timed out after {timeout:g} seconds",
                                 "error": "", "returncode": -1})
        return JSONResponse({"status": "success" if r.returncode == 0 else "error", "output": r.stdout,
                             "error": "", "returncode": r.returncode})

    @app.post("/start_recording")
    async def start_recording() -> JSONResponse:
        from osfarm.desktop.recording import RecordingError

        try:
            await run_in_threadpool(lambda: desk.recorder.start())
        except RecordingError as e:
            return JSONResponse({"status": "error", "message": e.message, "detail": e.message}, e.status)
        return JSONResponse({"status": "success", "message": "Started recording successfully."})

    @app.post("/end_recording")
    async def end_recording() -> Response:
        from osfarm.desktop.recording import RecordingError

        try:
            path = await run_in_threadpool(lambda: desk.recorder.stop())
        except RecordingError as e:
            return JSONResponse({"status": "error", "message": e.message, "detail": e.message}, e.status)
        return FileResponse(path, media_type="video/mp4", filename="recording.mp4", content_disposition_type="attachment")

    # ==================================================================== native /v1 routes

    @app.get("/v1/health", response_model=Health)
    async def health() -> Any:
        if not await run_in_threadpool(desk.x_alive):
            return JSONResponse({"detail": f"display: X server {desk.display} is gone"}, 503)
        w, h = await run_in_threadpool(desk.screen_size)
        return Health(display=desk.display, screen=ScreenSize(width=w, height=h),
                      uptime_s=round(time.time() - desk.started, 3), pid=os.getpid(), a11y_bus=desk.a11y_ok())

    def observe_sync(opts: ObserveOptions) -> Observation:
        """Everything an agent sees, gathered in parallel threads (the a11y tree is the slow part)."""
        from concurrent.futures import ThreadPoolExecutor

        from osfarm.desktop.capture import encode_frame

        t0 = time.perf_counter()
        w, h = desk.screen_size()
        obs = Observation(screen=ScreenSize(width=w, height=h))
        with ThreadPoolExecutor(max_workers=3) as pool:
            fut_a11y = pool.submit(_a11y_tree) if opts.a11y else None
            fut_win = pool.submit(desk.windows) if opts.windows else None
            if opts.screenshot:
                frame = desk.capture.grab_frame(cursor=True)
                data = encode_frame(frame, opts.format, opts.scale, opts.quality)
                obs.screenshot = base64.b64encode(data).decode("ascii")
                obs.format = opts.format
                if opts.scale < 1:
                    obs.width, obs.height = max(1, round(frame.width * opts.scale)), max(1, round(frame.height * opts.scale))
                else:
                    obs.width, obs.height = frame.width, frame.height
            if opts.cursor:
                obs.cursor = tuple(desk.input.cursor_position())  # type: ignore[assignment]
            if fut_win is not None:
                obs.windows = fut_win.result()
            if fut_a11y is not None:
                obs.a11y = fut_a11y.result()
        obs.t_ms = round((time.perf_counter() - t0) * 1000, 2)
        return obs

    def _a11y_tree() -> str | None:
        try:
            from osfarm.desktop.a11y import accessibility_tree

            return accessibility_tree()
        except Exception:
            return None

    @app.post("/v1/step", response_model=StepResult)
    async def step(req: StepRequest) -> Any:
        t0 = time.perf_counter()
        w, h = await run_in_threadpool(desk.screen_size)
        actions = []
        for i, raw in enumerate(req.actions):
            try:
                a = parse_action(raw, f"actions.{i}")
                check_on_screen(a, w, h, f"actions.{i}")
            except ActionError as e:
                raise HTTPException(422, str(e)) from None
            actions.append(a)

        def work() -> tuple[list[ActionResult], str | None]:
            results: list[ActionResult] = []
            done: str | None = None
            with desk.step_lock:
                for i, a in enumerate(actions):
                    term = is_terminal(a)
                    if term is not None:
                        results.append(ActionResult(index=i, ok=True, output=term))
                        done = term
                        break
                    if isinstance(a, CodeAction):
                        if a.special == "WAIT":
                            results.append(ActionResult(index=i, ok=True, output="WAIT"))
                            continue
                        res = desk.runner.run(a.code, timeout=req.code_timeout)
                        results.append(ActionResult(index=i, ok=res.ok, error=res.error, output=res.output or None))
                    elif getattr(a, "action_type", None) == "WAIT":
                        results.append(ActionResult(index=i, ok=True, output="WAIT"))
                        continue
                    else:
                        try:
                            desk.input.execute(a)
                            results.append(ActionResult(index=i, ok=True))
                        except ActionError as e:
                            results.append(ActionResult(index=i, ok=False, error=str(e)))
                        except Exception as e:  # an X error must not lose the step's results
                            results.append(ActionResult(index=i, ok=False, error=f"{type(e).__name__}: {e}"))
                    if not results[-1].ok:
                        break
            return results, done

        results, done = await run_in_threadpool(work)
        obs = await run_in_threadpool(observe_sync, req.observe) if req.observe is not None else None
        return StepResult(results=results, done=done, observation=obs,  # type: ignore[arg-type]
                          t_env_ms=round((time.perf_counter() - t0) * 1000, 2))

    @app.get("/v1/observation", response_model=Observation)
    async def observation(request: Request) -> Any:
        opts = _query_model(ObserveOptions, request)
        return await run_in_threadpool(observe_sync, opts)

    @app.get("/v1/screenshot")
    async def v1_screenshot(
        format: ImageFormat = "png",
        scale: float = Query(1.0, gt=0.0, le=1.0),
        quality: int = Query(80, ge=1, le=100),
        cursor: bool = True,
    ) -> Response:
        from osfarm.desktop.capture import encode_frame

        def work() -> tuple[bytes, int, int]:
            frame = desk.capture.grab_frame(cursor=cursor)
            data = encode_frame(frame, format, scale, quality)
            if scale < 1:
                return data, max(1, round(frame.width * scale)), max(1, round(frame.height * scale))
            return data, frame.width, frame.height

        data, w, h = await run_in_threadpool(work)
        return Response(data, media_type=MEDIA_TYPES[format],
                        headers={"X-Image-Width": str(w), "X-Image-Height": str(h)})

    @app.post("/v1/pyautogui", response_model=CodeResult)
    async def pyautogui_code(req: CodeRequest) -> Any:
        def work() -> CodeResult:
            with desk.step_lock:
                return desk.runner.run(req.code, timeout=req.timeout)

        return await run_in_threadpool(work)

    @app.post("/v1/wait_for_window", response_model=WaitResult)
    async def wait_for_window(req: WaitForWindow) -> Any:
        if not req.title and not req.wm_class:
            raise HTTPException(422, "title: give title and/or wm_class")
        from osfarm.desktop.windows import wait_for_window as wfw

        t0 = time.monotonic()
        win = await run_in_threadpool(lambda: wfw(req.title, req.wm_class, req.timeout, display=desk.display))
        waited = round(time.monotonic() - t0, 3)
        if win is None:
            what = " and ".join(f"{k}~{v!r}" for k, v in (("title", req.title), ("wm_class", req.wm_class)) if v)
            return WaitResult(ok=False, waited_s=waited, detail=f"no window with {what} after {req.timeout:g} s")
        return WaitResult(ok=True, waited_s=waited, detail=f"{win.title} ({win.wm_class})")

    @app.post("/v1/wait_for_file", response_model=WaitResult)
    async def wait_for_file(req: WaitForFile) -> Any:
        path = expand(req.path)

        def work() -> WaitResult:
            t0 = time.monotonic()
            while True:
                try:
                    size = os.stat(path).st_size
                    if size >= req.min_size:
                        return WaitResult(ok=True, waited_s=round(time.monotonic() - t0, 3), detail=f"{size} bytes")
                except OSError:
                    pass
                waited = time.monotonic() - t0
                if waited >= req.timeout:
                    return WaitResult(ok=False, waited_s=round(waited, 3),
                                      detail=f"{path} not present with >= {req.min_size} bytes after {req.timeout:g} s")
                time.sleep(min(0.05, req.timeout - waited))

        return await run_in_threadpool(work)

    return app


def _query_model(model: type[Any], request: Request) -> Any:
    """Validate query parameters into a pydantic model; errors name the parameter (422)."""
    from pydantic import ValidationError

    known = set(model.model_fields)
    params = {k: v for k, v in request.query_params.items() if k in known}
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise HTTPException(422, f"{unknown[0]}: unknown query parameter; expected one of {', '.join(sorted(known))}")
    try:
        return model.model_validate(params)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "query"
        raise HTTPException(422, f"{field}: {err['msg']}") from None


__all__ = ["BearerAuth", "create_app", "run_command"]
