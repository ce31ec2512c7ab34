"""The guest's OSWorld-compatible routes: same paths, payloads and replies as OSWorld's in-VM
server (see ``reference/osworld-guest-api.md``), with its known bugs fixed (module doc of
:mod:`osfarm.desktop.guest`)."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile


from osfarm.desktop.guest import (
    EXECUTE_TIMEOUT_S,
    OPEN_FILE_TIMEOUT_S,
    RUN_PYTHON_TIMEOUT_S,
    Desktop,
    bad,
    describe_command,
    directory_tree,
    expand,
    get_bool,
    get_command,
    get_num,
    get_str,
    json_object,
    paint_root,
    run_command,
    spawn_detached,
)


def add_osworld_routes(app: FastAPI, desk: Desktop) -> None:

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
