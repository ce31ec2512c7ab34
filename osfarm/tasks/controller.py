"""A synchronous client of one desktop's guest server: OSWorld's ``PythonController`` surface.

Method names and return shapes follow OSWorld's ``desktop_env/controllers/python.py`` so getters
written against it port directly, with one deliberate difference: nothing is retried once it may
have reached the guest. OSWorld retries every call three times, re-running commands, launches and
uploads that already ran. Here only a request that provably never left this process (the
connection could not be made) is re-tried by the transport; any other failure raises
:class:`GuestError` naming the route and the guest's message.

"Not found" replies become ``None`` / ``False`` where OSWorld's methods return ``None``
(``get_file``, ``get_window_size``, ``get_wallpaper``, ``get_directory_tree``,
``activate_window``, ``close_window``).

Files come out of the desktop with a byte cap, because the agent decides how big they are (a
100 GB sparse "result" file in the home): ``download_file`` streams one to disk and stops at
``max_file_bytes`` (default 1 GiB, ``OSFARM_MAX_GUEST_FILE_BYTES``), ``get_file`` (in memory)
at 64 MiB; over the cap raises :class:`GuestFileTooLarge` and nothing is kept.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Self

import httpx

from osfarm.http.errors import GuestError, error_detail

if TYPE_CHECKING:
    from osfarm.providers.base import GuestEndpoint

CONNECT_RETRIES = 2  # connect failures only: the request was never sent
MAX_FILE_BYTES = 1 << 30  # a desktop file streamed to disk (download_file)
MAX_IN_MEMORY_BYTES = 64 << 20  # a desktop file read into memory (get_file)
_CHUNK = 1 << 20


def max_file_bytes_from_env() -> int:
    value = os.environ.get("OSFARM_MAX_GUEST_FILE_BYTES", "")
    return int(value) if value.isdigit() and int(value) > 0 else MAX_FILE_BYTES


# What a farm in front of the guest answers when the desktop is gone or not answering.
UNREACHABLE_STATUSES = frozenset({410, 502, 503, 504})


class GuestFileTooLarge(GuestError):
    """A desktop file is over the byte cap; nothing of it was kept."""

    def __init__(self, route: str, path: str, limit: int, size: int | None = None):
        told = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        super().__init__(route, None, f"{path} is {told}, over the {limit}-byte limit for a desktop file")
        self.path, self.limit, self.size = path, limit, size


class GuestController:
    """One desktop's guest routes over a unix socket (``uds``) or a loopback ``base_url``."""

    def __init__(self, base_url: str = "http://guest", token: str | None = None, uds: str | None = None,
                 timeout: float = 120.0, max_file_bytes: int | None = None):
        self.max_file_bytes = max_file_bytes if max_file_bytes is not None else max_file_bytes_from_env()
        transport = httpx.HTTPTransport(uds=uds, retries=CONNECT_RETRIES) if uds else \
            httpx.HTTPTransport(retries=CONNECT_RETRIES)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url
        self.timeout = timeout
        self._http = httpx.Client(base_url=base_url, transport=transport, headers=headers, timeout=timeout)
        # Every time the desktop could not be reached, even where a caller swallowed the error (an
        # OSWorld getter returns None and its metric scores 0): an evaluation reads this to tell
        # "the agent's result is missing" from "the desktop was gone" (osfarm.tasks.lifecycle).
        self.unreachable: list[GuestError] = []

    @classmethod
    def from_endpoint(cls, endpoint: GuestEndpoint) -> GuestController:
        return cls(base_url=endpoint.base_url, token=endpoint.token, uds=endpoint.uds)

    # ------------------------------------------------------------------ plumbing

    def _request(self, method: str, route: str, *, ok_missing: bool = False, timeout: float | None = None,
                 **kw: Any) -> httpx.Response | None:
        """Send once. Returns None for 404 when ``ok_missing``; raises GuestError for other errors."""
        try:
            r = self._http.request(method, route, timeout=timeout if timeout is not None else self.timeout, **kw)
        except httpx.TimeoutException as e:
            raise self._gone(GuestError(route, None, f"no reply within the timeout ({type(e).__name__})")) from e
        except httpx.HTTPError as e:
            raise self._gone(GuestError(route, None, f"cannot reach the guest: {type(e).__name__}: {e}")) from e
        if r.status_code == 404 and ok_missing:
            return None
        if r.status_code >= 400:
            raise self._failed(route, r)
        return r

    def _gone(self, err: GuestError) -> GuestError:
        self.unreachable.append(err)
        return err

    def _failed(self, route: str, r: httpx.Response) -> GuestError:
        err = GuestError(route, r.status_code, error_detail(r.content, fallback=r.reason_phrase, limit=2000))
        return self._gone(err) if r.status_code in UNREACHABLE_STATUSES else err

    def _json(self, method: str, route: str, **kw: Any) -> Any:
        r = self._request(method, route, **kw)
        assert r is not None
        try:
            return r.json()
        except ValueError as e:
            raise GuestError(route, r.status_code, f"reply is not JSON: {r.text[:200]!r}") from e

    # ------------------------------------------------------------------ commands

    def execute(self, command: str | list[str], shell: bool = False, timeout: float = 120.0) -> dict:
        """POST /execute once: ``{status, output, error, returncode}`` (status "error" on timeout)."""
        data = self._json("POST", "/setup/execute", json={"command": command, "shell": shell, "timeout": timeout},
                          timeout=timeout + 15)
        return data

    def execute_with_verification(self, command: str | list[str], shell: bool = False,
                                  verification: dict | None = None, max_wait_time: float = 10.0,
                                  check_interval: float = 1.0) -> dict:
        """POST /setup/execute_with_verification; a failed verification is a reply, not an error."""
        route = "/setup/execute_with_verification"
        body = {"command": command, "shell": shell, "verification": verification or {},
                "max_wait_time": max_wait_time, "check_interval": check_interval}
        try:
            r = self._http.post(route, json=body, timeout=120 + max_wait_time + 15)
        except httpx.HTTPError as e:
            raise self._gone(GuestError(route, None, f"cannot reach the guest: {type(e).__name__}: {e}")) from e
        if r.status_code == 500:
            try:
                data = r.json()
            except ValueError:
                data = None
            if isinstance(data, dict) and data.get("status") == "verification_failed":
                return data
        if r.status_code >= 400:
            raise self._failed(route, r)
        return r.json()

    def launch(self, command: str | list[str], shell: bool = False) -> None:
        self._request("POST", "/setup/launch", json={"command": command, "shell": shell})

    def run_python(self, code: str) -> dict:
        return self._json("POST", "/run_python", json={"code": code}, timeout=60)

    def run_bash_script(self, script: str, timeout: float = 100.0, working_dir: str | None = None) -> dict:
        body: dict[str, Any] = {"script": script, "timeout": timeout}
        if working_dir:
            body["working_dir"] = working_dir
        return self._json("POST", "/run_bash_script", json=body, timeout=timeout + 15)

    # ------------------------------------------------------------------ files

    def upload_file(self, path: str, data: bytes) -> None:
        self._request("POST", "/setup/upload", data={"file_path": path},
                      files={"file_data": (os.path.basename(path) or "file", data)})

    def get_file(self, path: str, max_bytes: int = MAX_IN_MEMORY_BYTES) -> bytes | None:
        """The desktop file's bytes (None when missing); GuestFileTooLarge over ``max_bytes``."""
        chunks: list[bytes] = []
        found = self._stream_file(path, min(max_bytes, self.max_file_bytes), chunks.append)
        return b"".join(chunks) if found else None

    def download_file(self, path: str, dest: str | os.PathLike[str], max_bytes: int | None = None) -> bool:
        """Stream the desktop file ``path`` into ``dest`` (created or truncated, never through a
        symlink); False when it does not exist. Over ``max_bytes`` (default ``max_file_bytes``)
        raises GuestFileTooLarge and removes ``dest``."""
        limit = self.max_file_bytes if max_bytes is None else min(max_bytes, self.max_file_bytes)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                found = self._stream_file(path, limit, f.write)
        except BaseException:
            os.unlink(dest)
            raise
        if not found:
            os.unlink(dest)
        return found

    def _stream_file(self, path: str, limit: int, sink: Any) -> bool:
        """POST /file, the body handed to ``sink`` chunk by chunk; False on 404."""
        route = "/file"
        try:
            with self._http.stream("POST", route, data={"file_path": path}) as r:
                if r.status_code == 404:
                    return False
                if r.status_code >= 400:
                    r.read()
                    raise self._failed(route, r)
                announced = r.headers.get("content-length", "")
                if announced.isdigit() and int(announced) > limit:
                    raise GuestFileTooLarge(route, path, limit, int(announced))
                got = 0
                for chunk in r.iter_raw(_CHUNK):
                    got += len(chunk)
                    if got > limit:
                        raise GuestFileTooLarge(route, path, limit)
                    sink(chunk)
        except httpx.TimeoutException as e:
            raise self._gone(GuestError(route, None, f"no reply within the timeout ({type(e).__name__})")) from e
        except httpx.HTTPError as e:
            raise self._gone(GuestError(route, None, f"cannot reach the guest: {type(e).__name__}: {e}")) from e
        return True

    def get_directory_tree(self, path: str) -> dict | None:
        route = "/list_directory"
        try:
            r = self._http.post(route, json={"path": path})
        except httpx.HTTPError as e:
            raise self._gone(GuestError(route, None, f"cannot reach the guest: {type(e).__name__}: {e}")) from e
        if r.status_code in (400, 404):  # not a directory / missing
            return None
        if r.status_code >= 400:
            raise self._failed(route, r)
        return r.json().get("directory_tree")

    def wait_for_file(self, path: str, timeout: float = 30.0, min_size: int = 0) -> bool:
        data = self._json("POST", "/v1/wait_for_file", json={"path": path, "timeout": timeout, "min_size": min_size},
                          timeout=timeout + 15)
        return bool(data.get("ok"))

    # ------------------------------------------------------------------ windows and apps

    def open_file(self, path: str, timeout: float = 120.0) -> None:
        """Open a file (or start a program) and wait until its window is there and active."""
        self._request("POST", "/setup/open_file", json={"path": path, "timeout_seconds": timeout},
                      timeout=timeout + 15)

    def _window_op(self, route: str, window_name: str, strict: bool, by_class: bool) -> bool:
        r = self._request("POST", route, json={"window_name": window_name, "strict": strict, "by_class": by_class},
                          ok_missing=True)
        return r is not None

    def activate_window(self, window_name: str, strict: bool = False, by_class: bool = False) -> bool:
        return self._window_op("/setup/activate_window", window_name, strict, by_class)

    def close_window(self, window_name: str, strict: bool = False, by_class: bool = False) -> bool:
        return self._window_op("/setup/close_window", window_name, strict, by_class)

    def wait_for_window(self, title: str | None = None, wm_class: str | None = None, timeout: float = 30.0) -> bool:
        data = self._json("POST", "/v1/wait_for_window",
                          json={"title": title, "wm_class": wm_class, "timeout": timeout},
                          timeout=timeout + 15)
        return bool(data.get("ok"))

    def get_window_size(self, app_class_name: str) -> dict | None:
        r = self._request("POST", "/window_size", data={"app_class_name": app_class_name}, ok_missing=True)
        return None if r is None else r.json()

    def start_recording(self) -> None:
        """POST /start_recording: the guest starts an mp4 screen recording."""
        self._request("POST", "/start_recording")

    def end_recording(self, timeout: float = 60.0) -> bytes:
        """POST /end_recording: stops the recording and returns the mp4."""
        r = self._request("POST", "/end_recording", timeout=timeout)
        assert r is not None
        return r.content

    # ------------------------------------------------------------------ observations

    def screenshot(self) -> bytes:
        r = self._request("GET", "/screenshot")
        assert r is not None
        return r.content

    def get_screen_size(self) -> tuple[int, int]:
        data = self._json("POST", "/screen_size")
        return int(data["width"]), int(data["height"])

    def get_terminal_output(self) -> str | None:
        try:
            data = self._json("GET", "/terminal")
        except GuestError as e:
            if e.status in (404, 503):
                return None
            raise
        return data.get("output")

    def get_accessibility_tree(self) -> str | None:
        try:
            data = self._json("GET", "/accessibility")
        except GuestError as e:
            if e.status in (404, 503):
                return None
            raise
        return data.get("AT")

    def get_wallpaper(self) -> bytes | None:
        r = self._request("POST", "/wallpaper", ok_missing=True)
        return None if r is None else r.content

    def change_wallpaper(self, path: str) -> None:
        self._request("POST", "/setup/change_wallpaper", json={"path": path})

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["GuestController", "GuestError", "GuestFileTooLarge"]
