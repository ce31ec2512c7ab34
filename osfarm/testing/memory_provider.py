"""A real Provider whose boxes live in this process, for fast, deterministic pool tests.

Each box is a tiny HTTP/1.1 server on a unix socket answering the guest's ``GET /v1/health``,
so the pool's health checks go over real HTTP to something that can really stop answering.
The test steers it: ``hold()`` keeps starts and resets pending (the pool's ``starting`` and
``resetting`` states stay observable), ``fail_starts`` makes the next starts fail, ``kill`` makes
a box dead (``alive`` says why), ``silence`` closes its guest (connection refused), and
``orphans`` is what ``reap_orphans`` reports. Boxes outlive the pool that started them (as docker
containers and libvirt VMs outlive their farm): ``adopt`` hands a new pool a box that still runs;
``survives_farm=False`` makes them die with it, as sandbox boxes do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from osfarm.providers.base import DesktopHandle, DesktopSpec, GuestEndpoint, ProviderError

HEALTH = json.dumps({"status": "ok"}).encode()
# GET /v1/observation: a fixed observation (a 4 KiB stand-in screenshot), so the farm's
# observation route can be driven without a desktop (load and leak measurements)
OBSERVATION = json.dumps({"screenshot": "A" * 4096, "format": "png", "width": 1024, "height": 768,
                          "screen": {"width": 1024, "height": 768}, "cursor": [0, 0], "windows": [],
                          "a11y": None, "t_ms": 0.1}).encode()
# POST /v1/step: the actions' results (none: the box runs nothing), so the farm's step route
# answers as on a desktop once it has checked the actions
STEP = json.dumps({"results": [], "done": None, "observation": None, "t_env_ms": 0.1}).encode()


@dataclass
class _Box:
    handle: DesktopHandle
    server: asyncio.AbstractServer
    connections: set[asyncio.StreamWriter]
    dead: str | None = None

    def shut(self) -> None:
        """Stop listening and drop the open keep-alive connections too."""
        self.server.close()
        for writer in self.connections:
            writer.close()
        Path(self.handle.endpoint.uds or "").unlink(missing_ok=True)


@dataclass
class MemoryProvider:
    orphans: int = 0
    fail_starts: int = 0  # the next this many starts (or resets) raise ProviderError
    name: str = "memory"
    boxes: dict[str, _Box] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)  # desktop ids, one entry per start or reset
    stopped: list[str] = field(default_factory=list)
    closed: bool = False
    survives_farm: bool = True
    adopted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="osfm")
        self._gate = asyncio.Event()
        self._gate.set()
        self._serial = 0

    # -- steering -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Starts and resets begun inside the block wait until it ends."""
        self._gate.clear()
        try:
            yield
        finally:
            self._gate.set()

    def release_held(self) -> None:
        self._gate.set()

    def kill(self, desktop_id: str, reason: str = "box killed") -> None:
        self.boxes[desktop_id].dead = reason

    def silence(self, desktop_id: str) -> None:
        """The guest server stops answering (its socket refuses connections)."""
        self.boxes[desktop_id].shut()

    # -- the Provider protocol ----------------------------------------------------------------

    async def reap_orphans(self) -> int:
        return self.orphans

    async def start(self, desktop_id: str, spec: DesktopSpec) -> DesktopHandle:
        if self.closed:
            raise ProviderError("memory provider is closed")
        await self._gate.wait()
        if self.fail_starts > 0:
            self.fail_starts -= 1
            raise ProviderError(f"desktop {desktop_id}: no room for a box (test failure)")
        self._serial += 1
        sock = str(Path(self._dir.name) / f"{desktop_id}-{self._serial}.sock")
        connections: set[asyncio.StreamWriter] = set()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.add(writer)
            try:
                await _serve_health(reader, writer)
            finally:
                connections.discard(writer)

        server = await asyncio.start_unix_server(serve, path=sock)
        handle = DesktopHandle(id=desktop_id, provider=self.name, spec=spec,
                               endpoint=GuestEndpoint(base_url="http://guest", token="t", uds=sock),
                               info={"image": "memory:1"})
        self.boxes[desktop_id] = _Box(handle, server, connections)
        self.started.append(desktop_id)
        return handle

    async def adopt(self, handle: DesktopHandle) -> DesktopHandle | None:
        """The running box a previous pool saved as ``handle`` (None when it is gone or dead)."""
        box = self.boxes.get(handle.id)
        if not self.survives_farm or box is None or box.dead or box.handle.endpoint != handle.endpoint:
            return None
        self.adopted.append(handle.id)
        return box.handle

    async def stop(self, handle: DesktopHandle) -> None:
        box = self.boxes.get(handle.id)
        if box is not None and box.handle is handle:
            del self.boxes[handle.id]
            box.shut()
        self.stopped.append(handle.id)

    async def reset(self, handle: DesktopHandle) -> DesktopHandle:
        await self.stop(handle)
        return await self.start(handle.id, handle.spec)

    async def alive(self, handle: DesktopHandle) -> str | None:
        box = self.boxes.get(handle.id)
        if box is None or box.handle is not handle:
            return "box is gone"
        return box.dead

    def pids(self, handle: DesktopHandle) -> list[int]:
        return []

    async def close(self) -> None:
        for box in list(self.boxes.values()):
            box.shut()
        self.closed = True
        self._dir.cleanup()


async def _serve_health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 with keep-alive: 200 and a JSON body for /v1/health, /v1/observation and
    POST /v1/step, 404 for anything else."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            method, _, rest = head.partition(b" ")
            target = rest.split(b" ", 1)[0].split(b"?", 1)[0]
            await _skip_body(reader, head)
            if target == b"/v1/health":
                status, body = b"200 OK", HEALTH
            elif target == b"/v1/observation":
                status, body = b"200 OK", OBSERVATION
            elif target == b"/v1/step" and method == b"POST":
                status, body = b"200 OK", STEP
            else:
                status, body = b"404 Not Found", b'{"detail":"no"}'
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + (b"" if method == b"HEAD" else body))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _skip_body(reader: asyncio.StreamReader, head: bytes) -> None:
    """Read the request's body (Content-Length or chunked) so the next request starts clean."""
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(b":") for line in head.split(b"\r\n")[1:] if b":" in line)}
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return
    n = int(headers.get(b"content-length", b"0") or 0)
    if n:
        await reader.readexactly(n)
