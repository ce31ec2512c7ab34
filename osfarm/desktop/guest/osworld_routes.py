"""The guest's OSWorld-compatible routes: same paths, payloads and replies as OSWorld's in-VM
server (see ``reference/osworld-guest-api.md``), with its known bugs fixed (module doc of
:mod:`osfarm.desktop.guest.guest`)."""

from __future__ import annotations

import io
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from PIL import Image
from starlette.concurrency import run_in_threadpool

from osfarm.desktop.box.agent_files import MAX_READ_BYTES, AgentFileError
from osfarm.desktop.box.commands import CANNOT_START, Command, run_command, spawn_detached
from osfarm.desktop.guest.request_fields import (
    bad,
    describe_command,
    expand,
    form_file,
    form_str,
    get_bool,
    get_command,
    get_num,
    json_object,
    optional_str,
    require_str,
)
from osfarm.desktop.session.a11y import accessibility_tree, terminal_text
from osfarm.desktop.session.gnome_wallpaper import WallpaperError, current_wallpaper, set_wallpaper
from osfarm.desktop.session.guest_state import DesktopDep
from osfarm.desktop.x11 import windows
from osfarm.desktop.x11.capture import encode_image
from osfarm.desktop.x11.recording import RecordingError
from osfarm.desktop.x11.wallpaper import paint_root

EXECUTE_TIMEOUT_S = 120.0  # OSWorld's subprocess.run timeout for /execute
RUN_PYTHON_TIMEOUT_S = 30.0
DOWNLOAD_TIMEOUT_S = 900.0  # OSWorld: 3 tries of up to 300 s each
OPEN_FILE_TIMEOUT_S = 120.0
# A file the guest sends (``/file``): over this it answers 413 before sending a byte (a sparse
# 100 GB "result" would otherwise stream for hours).
MAX_FILE_BYTES = MAX_READ_BYTES
WALLPAPER_MAX_BYTES = 64 << 20  # OSWorld waits up to 1800 s; callers may pass timeout_seconds

router = APIRouter()


def downloads() -> ModuleType:
    """:mod:`osfarm.http.download`, imported by the first ``/setup/download_file``: it imports
    httpx (which imports click, rich and pygments for its command line: ~70 ms of every cold
    start for a route most tasks never call)."""
    from osfarm.http import download

    return download


def cannot_start(command: Command, e: OSError, verb: str = "run") -> HTTPException:
    """The 400 for a program that could not be started (missing, not executable, bad cwd)."""
    return bad("command", f"cannot {verb} {describe_command(command)!r}: {e.strerror or e}")


def directory_tree(path: str, max_entries: int = 200_000) -> dict[str, Any]:
    """``/list_directory``'s reply: nested {type, name, children} as OSWorld builds it."""
    count = 0

    def walk(p: str) -> dict[str, Any]:
        nonlocal count
        node: dict[str, Any] = {"type": "directory", "name": os.path.basename(p.rstrip("/")) or p, "children": []}
        try:
            entries = sorted(os.scandir(p), key=lambda e: e.name)
        except OSError as e:
            return {"error": str(e)}
        for entry in entries:
            count += 1
            if count > max_entries:
                break
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            node["children"].append(walk(entry.path) if is_dir else {"type": "file", "name": entry.name})
        return node

    return walk(path)


# --------------------------------------------------------------------------- commands


@router.post("/execute")
@router.post("/setup/execute")
async def execute(request: Request, desk: DesktopDep) -> JSONResponse:
    data = await json_object(request)
    command, shell = get_command(data)
    timeout = get_num(data, "timeout", EXECUTE_TIMEOUT_S)
    try:
        r = await run_in_threadpool(lambda: run_command(command, shell, timeout, desk.home, agent=desk.agent))
    except CANNOT_START as e:
        raise cannot_start(command, e) from None
    reply: dict[str, Any] = {"status": "success", "output": r.stdout, "error": r.stderr, "returncode": r.returncode}
    if r.timed_out:
        # 200, not OSWorld's 500: its client would re-run the command three times.
        reply.update(status="error", message=f"command timed out after {timeout:g} s")
    return JSONResponse(reply)


@router.post("/execute_with_verification")
@router.post("/setup/execute_with_verification")
async def execute_with_verification(request: Request, desk: DesktopDep) -> JSONResponse:
    data = await json_object(request)
    command, shell = get_command(data)
    verification = data.get("verification") or {}
    if not isinstance(verification, dict):
        raise bad("verification", f"expected an object, got {type(verification).__name__}")
    window_exists = optional_str(verification, "window_exists")
    command_success = optional_str(verification, "command_success")
    max_wait = get_num(data, "max_wait_time", 10.0)
    interval = get_num(data, "check_interval", 1.0, hi=60.0)

    def work() -> tuple[dict[str, Any], int]:
        r = run_command(command, shell, EXECUTE_TIMEOUT_S, desk.home, agent=desk.agent)
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
                ok = run_command(command_success, True, 5.0, desk.home, agent=desk.agent).returncode == 0
            waited = time.monotonic() - t0
            if ok:
                return {"status": "success", **base, "verification": "passed", "wait_time": waited}, 200
            if waited + interval > max_wait:
                return {"status": "verification_failed", **base, "verification": "failed",
                        "wait_time": waited}, 500
            time.sleep(interval)

    try:
        reply, status = await run_in_threadpool(work)
    except CANNOT_START as e:
        raise cannot_start(command, e) from None
    return JSONResponse(reply, status)


@router.post("/setup/launch")
async def launch(request: Request, desk: DesktopDep) -> PlainTextResponse:
    data = await json_object(request)
    command, shell = get_command(data)
    try:
        await run_in_threadpool(lambda: spawn_detached(command, shell, desk.home, agent=desk.agent))
    except CANNOT_START as e:
        raise cannot_start(command, e, "launch") from None
    return PlainTextResponse(f"{describe_command(command)} launched successfully")


@router.post("/run_python")
async def run_python(request: Request, desk: DesktopDep) -> JSONResponse:
    data = await json_object(request)
    code = require_str(data, "code")
    script = desk.script_path(f"python_exec_{os.getpid()}_{time.monotonic_ns()}.py", code)
    try:
        r = await run_in_threadpool(lambda: run_command([desk.code_python or sys.executable, str(script)], False,
                                                        RUN_PYTHON_TIMEOUT_S, desk.home, agent=desk.agent))
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


@router.post("/run_bash_script")
async def run_bash_script(request: Request, desk: DesktopDep) -> JSONResponse:
    data = await json_object(request)
    script = require_str(data, "script")
    timeout = get_num(data, "timeout", 100.0)
    wd = optional_str(data, "working_dir")
    cwd = expand(wd) if wd else desk.home
    if not await run_in_threadpool(desk.is_dir, cwd):
        raise bad("working_dir", f"not a directory: {cwd}")
    if "#!/bin/bash" not in script:
        script = "#!/bin/bash\n\n" + script
    path = desk.script_path(f"bash_{os.getpid()}_{time.monotonic_ns()}.sh", script)
    try:
        r = await run_in_threadpool(lambda: run_command(["/bin/bash", str(path)], False, timeout, cwd, True,
                                                        agent=desk.agent))
    finally:
        path.unlink(missing_ok=True)
    if r.timed_out:
        return JSONResponse({"status": "error",
                             "output": r.stdout + f"\nScript execution timed out after {timeout:g} seconds",
                             "error": "", "returncode": -1})
    return JSONResponse({"status": "success" if r.returncode == 0 else "error", "output": r.stdout,
                         "error": "", "returncode": r.returncode})


# --------------------------------------------------------------------------- observing


@router.get("/screenshot")
async def screenshot(desk: DesktopDep) -> Response:
    def work() -> bytes:
        # OSWorld saves with Pillow's default zlib level (6); the compatible route keeps
        # that so it behaves like OSWorld's. /v1/screenshot is the fast path.
        return encode_image(desk.capture.grab(cursor=True), "png", png_level=6)

    return Response(await run_in_threadpool(work), media_type="image/png")


@router.get("/accessibility")
async def accessibility() -> JSONResponse:
    return JSONResponse({"AT": await run_in_threadpool(accessibility_tree)})


@router.get("/terminal")
async def terminal() -> JSONResponse:
    return JSONResponse({"output": await run_in_threadpool(terminal_text), "status": "success"})


@router.post("/screen_size")
async def screen_size(desk: DesktopDep) -> JSONResponse:
    w, h = await run_in_threadpool(desk.screen_size)
    return JSONResponse({"width": w, "height": h})


@router.post("/window_size")
async def window_size(request: Request, desk: DesktopDep) -> JSONResponse:
    name = form_str(await request.form(), "app_class_name")
    size = await run_in_threadpool(lambda: windows.window_size(name, display=desk.display))
    if size is None:
        raise bad("app_class_name", f"no window with WM_CLASS {name!r}", 404)
    return JSONResponse({"width": size[0], "height": size[1]})


@router.get("/cursor_position")
async def cursor_position(desk: DesktopDep) -> JSONResponse:
    x, y = await run_in_threadpool(lambda: desk.input.cursor_position())
    return JSONResponse([x, y])


@router.get("/platform")
async def get_platform() -> PlainTextResponse:
    return PlainTextResponse(platform.system())


@router.post("/desktop_path")
async def desktop_path(desk: DesktopDep) -> JSONResponse:
    path = os.path.join(desk.home, "Desktop")
    if not os.path.isdir(path):
        return JSONResponse({"error": "desktop path not found", "detail": f"desktop_path: {path} does not exist"}, 404)
    return JSONResponse({"desktop_path": path})


# --------------------------------------------------------------------------- wallpaper


@router.post("/wallpaper")
async def wallpaper(desk: DesktopDep) -> Response:
    path = desk.wallpaper
    if desk.session == "gnome":
        try:
            path = await run_in_threadpool(current_wallpaper, desk.agent, desk.home)
        except WallpaperError as e:
            return JSONResponse({"detail": f"wallpaper: {e}"}, 404)
    if not path or not await run_in_threadpool(desk.is_file, path):
        return JSONResponse({"detail": "wallpaper: no wallpaper set"}, 404)
    if desk.files is None:
        return FileResponse(path, media_type="image/png")
    try:
        data = await run_in_threadpool(desk.files.read_bytes, path, WALLPAPER_MAX_BYTES)
    except AgentFileError as e:
        return JSONResponse({"detail": f"wallpaper: cannot read {path}: {e.message}"}, 404)
    return Response(data, media_type="image/png")


@router.post("/setup/change_wallpaper")
async def change_wallpaper(request: Request, desk: DesktopDep) -> PlainTextResponse:
    data = await json_object(request)
    path = Path(expand(require_str(data, "path")))
    if not await run_in_threadpool(desk.is_file, str(path)):
        raise bad("path", f"file not found: {path}", 404)

    def paint() -> None:
        if desk.files is None:
            paint_root(desk.display, str(path))
            return
        try:
            image = io.BytesIO(desk.files.read_bytes(str(path), WALLPAPER_MAX_BYTES))
        except AgentFileError as e:
            raise OSError(e.message) from None
        paint_root(desk.display, image)

    def check_image() -> None:
        data = desk.files.read_bytes(str(path), WALLPAPER_MAX_BYTES) if desk.files else Path(path).read_bytes()
        with Image.open(io.BytesIO(data)) as img:
            img.verify()

    if desk.session == "gnome":
        # the shell draws the background from its settings key (osfarm.desktop.session.gnome_wallpaper)
        try:
            await run_in_threadpool(check_image)
        except (OSError, AgentFileError, SyntaxError) as e:  # PIL: not an image
            raise bad("path", f"not an image: {e}") from None
        try:
            await run_in_threadpool(set_wallpaper, desk.agent, desk.home, str(path))
        except WallpaperError as e:
            raise HTTPException(500, f"change_wallpaper: {e}") from None
        return PlainTextResponse("Wallpaper changed successfully")
    try:
        await run_in_threadpool(paint)
    except OSError as e:  # PIL cannot read it
        raise bad("path", f"not an image: {e}") from None
    desk.wallpaper = str(path)
    return PlainTextResponse("Wallpaper changed successfully")


# --------------------------------------------------------------------------- files


@router.post("/list_directory")
async def list_directory(request: Request, desk: DesktopDep) -> JSONResponse:
    data = await json_object(request)
    path = expand(require_str(data, "path"))
    if desk.files is not None:
        try:
            return JSONResponse({"directory_tree": await run_in_threadpool(desk.files.list_tree, path)})
        except AgentFileError as e:
            raise bad("path", f"not a directory: {path}" if e.kind in ("notdir", "notfound") else
                      f"cannot list {path}: {e.message}") from None
    if not os.path.isdir(path):
        raise bad("path", f"not a directory: {path}")
    return JSONResponse({"directory_tree": await run_in_threadpool(directory_tree, path)})


@router.post("/file")
async def get_file(request: Request, desk: DesktopDep) -> Response:
    path = expand(form_str(await request.form(), "file_path"))
    if desk.files is not None:
        files = desk.files
        try:
            size, chunks = await run_in_threadpool(files.open_read, path, MAX_FILE_BYTES)
        except AgentFileError as e:
            if e.kind == "isdir":
                raise bad("file_path", f"is a directory: {path}") from None
            if e.kind == "toolarge":
                raise bad("file_path", f"{path} is {e.size} bytes, over the guest's limit of {MAX_FILE_BYTES} "
                          "bytes (MAX_FILE_BYTES)", 413) from None
            if e.kind in ("notfound", "notfile"):
                return JSONResponse({"error": "File not found", "detail": f"file_path: file not found: {path}"}, 404)
            raise bad("file_path", f"cannot read {path}: {e.message}") from None
        name = os.path.basename(path)
        return StreamingResponse(chunks, media_type="application/octet-stream", headers={
            "content-length": str(size),
            "content-disposition": f"attachment; filename*=utf-8''{quote(name)}"})
    if os.path.isdir(path):
        raise bad("file_path", f"is a directory: {path}")
    if not os.path.isfile(path):
        return JSONResponse({"error": "File not found", "detail": f"file_path: file not found: {path}"}, 404)
    return FileResponse(path, filename=os.path.basename(path), content_disposition_type="attachment")


@router.post("/setup/upload")
async def upload(request: Request, desk: DesktopDep) -> PlainTextResponse:
    form = await request.form()
    path = expand(form_str(form, "file_path"))
    up = form_file(form, "file_data")
    if desk.files is not None:
        try:
            size = await run_in_threadpool(desk.files.write, path, up.file)
        except AgentFileError as e:
            raise bad("file_path", f"cannot write {path}: {e.message}") from None
        return PlainTextResponse(f"File Uploaded: {size} bytes")

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


@router.post("/setup/download_file")
async def download_file(request: Request, desk: DesktopDep) -> PlainTextResponse:
    """OSWorld's ``{url, path}``: the desktop itself downloads ``url`` to ``path``. Its limits
    are :mod:`osfarm.http.download`'s (http(s) only, no redirect off http(s), no private
    addresses unless on ``$OSFARM_DOWNLOAD_ALLOW_HOSTS``, size and time caps, a truncated body
    detected and resumed); a URL the policy refuses answers 400 naming ``url``, a download that
    fails answers 500 as OSWorld's does, leaving no partial file at ``path``."""
    data = await json_object(request)
    url = require_str(data, "url")
    path = expand(require_str(data, "path"))
    if await run_in_threadpool(desk.is_dir, path):
        raise bad("path", f"is a directory: {path}")
    dl = downloads()
    policy = dl.DownloadPolicy.from_env(timeout_s=DOWNLOAD_TIMEOUT_S)
    if desk.files is not None:
        # Fetched into the guest's own dir, then written as the agent (see agent_files).
        staged = str(desk.work_dir / f"download_{os.getpid()}_{time.monotonic_ns()}")
        try:
            try:
                got = await dl.download(url, staged, policy, lock=False)
            except dl.DownloadRefused as e:
                raise bad("url", e.reason) from None
            except dl.DownloadError as e:
                return PlainTextResponse(f"Failed to download {url}. No retries left. Error: {e.reason}", 500)

            def place() -> int:
                with open(staged, "rb") as f:
                    return desk.files.write(path, f)  # type: ignore[union-attr]

            try:
                size = await run_in_threadpool(place)
            except AgentFileError as e:
                raise bad("path", f"cannot write {path}: {e.message}") from None
            return PlainTextResponse(f"File downloaded successfully: {size} bytes")
        finally:
            for leftover in (staged, staged + ".part", staged + ".part.json"):
                Path(leftover).unlink(missing_ok=True)
    try:
        got = await dl.download(url, path, policy, lock=False)
    except dl.DownloadRefused as e:
        raise bad("url", e.reason) from None
    except dl.DownloadError as e:
        Path(path + ".part").unlink(missing_ok=True)
        Path(path + ".part.json").unlink(missing_ok=True)
        return PlainTextResponse(f"Failed to download {url}. No retries left. Error: {e.reason}", 500)
    except OSError as e:
        raise bad("path", f"cannot write {path}: {e.strerror or e}") from None
    return PlainTextResponse(f"File downloaded successfully: {got.size} bytes")


# --------------------------------------------------------------------------- windows


@router.post("/setup/open_file")
async def open_file(request: Request, desk: DesktopDep) -> PlainTextResponse:
    data = await json_object(request)
    raw = require_str(data, "path")
    window_name = optional_str(data, "window_name")
    timeout = get_num(data, "timeout_seconds", OPEN_FILE_TIMEOUT_S, hi=1800.0)
    path = Path(expand(raw))
    if await run_in_threadpool(desk.exists, str(path)):
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
        spawn_detached(command, False, desk.home, agent=desk.agent)
        deadline = time.monotonic() + timeout
        while True:
            for w in desk.windows():
                if any(c in w.title for c in candidates):
                    windows.activate_window(w.title, strict=True, display=desk.display)
                    return w.title
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    title = await run_in_threadpool(work)
    if title is None:
        raise HTTPException(504, f"path: no window titled like {candidates} within {timeout:g} s")
    return PlainTextResponse("File opened and window activated successfully")


def _window_route(act: Callable[..., bool], done: str) -> Callable[[Request, DesktopDep], Awaitable[PlainTextResponse]]:
    """A route that finds a window by name with wmctrl's matching rules and acts on it."""

    async def handler(request: Request, desk: DesktopDep) -> PlainTextResponse:
        data = await json_object(request)
        name = require_str(data, "window_name")
        strict = get_bool(data, "strict", False)
        by_class = get_bool(data, "by_class", False)
        found = await run_in_threadpool(lambda: act(name, strict=strict, by_class=by_class, display=desk.display))
        if not found:
            raise bad("window_name", f"window {name!r} not found", 404)
        return PlainTextResponse(done)

    return handler


router.post("/setup/activate_window")(_window_route(windows.activate_window, "Window activated successfully"))
router.post("/setup/close_window")(_window_route(windows.close_window, "Window closed successfully."))


# --------------------------------------------------------------------------- recording


def _recording_error(e: RecordingError) -> JSONResponse:
    return JSONResponse({"status": "error", "message": e.message, "detail": e.message}, e.status)


@router.post("/start_recording")
async def start_recording(desk: DesktopDep) -> JSONResponse:
    try:
        await run_in_threadpool(lambda: desk.recorder.start())
    except RecordingError as e:
        return _recording_error(e)
    return JSONResponse({"status": "success", "message": "Started recording successfully."})


@router.post("/end_recording")
async def end_recording(desk: DesktopDep) -> Response:
    try:
        path = await run_in_threadpool(lambda: desk.recorder.stop())
    except RecordingError as e:
        return _recording_error(e)
    return FileResponse(path, media_type="video/mp4", filename="recording.mp4", content_disposition_type="attachment")
