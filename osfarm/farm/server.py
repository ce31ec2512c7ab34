"""``FarmServer``: the farm app under uvicorn in a background thread, on a loopback port bound up
front. The tests, the demo command and the in-process farm of ``osfarm eval``/``train`` use it."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from osfarm.config import FarmSettings
from osfarm.farm.api import UiMount, create_app
from osfarm.farm.state import FarmState
from osfarm.http.listen import listening_socket
from osfarm.providers.base import Provider


class FarmServer:
    """The farm under uvicorn in a background thread, on a loopback socket bound up front.

    ``start()`` returns once the API answers (and, by default, the pool is warm); ``stop()``
    runs the lifespan shutdown, which destroys every desktop. Thread-safe to start/stop from
    one controlling thread.
    """

    def __init__(self, settings: FarmSettings, provider: Provider | None = None, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", ui: UiMount | None = None):
        self.settings = settings.ensure_token()
        self.app = create_app(settings, provider, ui)
        self.state: FarmState = self.app.state.farm
        self._sock = listening_socket(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, log_config=None, lifespan="on",
                                                     loop=settings.server_loop))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def token(self) -> str:
        return self.settings.token

    @property
    def open_connections(self) -> int:
        """HTTP connections the server has accepted and holds now."""
        return len(self._server.server_state.connections)

    def start(self, timeout: float = 120.0, warm: bool = True) -> str:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="osfarm-farm", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                err = self.state.start_error
                self.stop()
                raise RuntimeError(f"the farm did not start: {err or 'timed out'}")
            time.sleep(0.02)
        if warm and self.state.pool is not None and self.state.loop is not None:
            fut = asyncio.run_coroutine_threadsafe(
                self.state.pool.wait_warm(max(1.0, deadline - time.monotonic())), self.state.loop)
            try:
                fut.result(timeout=max(1.0, deadline - time.monotonic()) + 5)
            except BaseException:
                self.stop()
                raise
        return self.url

    def stop(self, timeout: float = 60.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> FarmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
