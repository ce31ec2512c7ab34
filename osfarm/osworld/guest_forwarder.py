"""``env.vm_ip:env.server_port``: a loopback HTTP port that forwards to the leased desktop's guest.

OSWorld's agents and scripts call the VM's guest server directly (``http://{vm_ip}:5000/screenshot``,
``/execute``, ``/accessibility``...). An osfarm desktop's guest is reached through the farm's
passthrough, ``/v1/desktops/{lease}/guest/{path}``, with the farm's token, which such code cannot
say. This server listens on 127.0.0.1 (an ephemeral port) and sends each request on through the
farm client's :meth:`~osfarm.client.AsyncRemoteDesktop.guest`, adding the lease's path and the
token; the lease changes with each ``reset`` and the port stays. Before the first ``reset`` (or
after ``close``) it answers 503.

Many agents write the port as 5000, OSWorld's, instead of reading ``server_port``; so the server
takes port 5000 on a loopback address of its own (127.x.y.z: each env has one, any number of
envs on one host), and an ephemeral port on 127.0.0.1 only where no such address is free.

It runs on the drop-in's private event loop (uvicorn's server on a socket bound here, so the port
is known before the first request); nothing of it blocks that loop.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from osfarm.client import AsyncRemoteDesktop, FarmAPIError
from osfarm.http.body_limit import BodyLimit, BodyRule

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Headers carried each way; the rest are hop-by-hop or recomputed by the next connection
# (the farm's passthrough keeps the same lists).
_REQUEST_HEADERS = ("content-type", "accept")
_RESPONSE_HEADERS = ("content-type", "content-disposition", "cache-control")
# The port OSWorld's guest server listens on, which agents often write out.
OSWORLD_GUEST_PORT = 5000
# Request bodies are read whole before they are forwarded, so they are capped as the guest caps
# them (it would refuse more anyway): the agent's code decides what it sends here.
MAX_BODY_BYTES = 16 << 20
MAX_UPLOAD_BYTES = 1 << 30
# Guest calls that legitimately take long (OSWorld's /setup/open_file waits for a window).
_GUEST_TIMEOUT_S = 1900.0


class GuestForwarder:
    """The loopback port; :attr:`desktop` is the lease it forwards to (None: answer 503)."""

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = 0
        self.desktop: AsyncRemoteDesktop | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind the port and serve; the port."""
        sock = _bind_loopback()
        self.host, self.port = sock.getsockname()[:2]
        capped = BodyLimit(self, max_bytes=MAX_BODY_BYTES, setting="the drop-in's MAX_BODY_BYTES (the guest's too)",
                           rules=[BodyRule(r"/setup/upload$", MAX_UPLOAD_BYTES, "the guest's MAX_UPLOAD_BYTES")])
        config = uvicorn.Config(capped, lifespan="off", log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # the server's own error
                raise RuntimeError("the guest forwarder stopped before it started")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        self.desktop = None
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        desk = self.desktop
        if desk is None:
            await _answer(send, 503, {"detail": "no desktop is leased: call env.reset() first"})
            return
        body = bytearray()
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope["query_string"] else "")
        try:
            r = await desk.guest(scope["method"], path, check=False, content=bytes(body),
                                 headers={k: headers[k] for k in _REQUEST_HEADERS if k in headers},
                                 timeout=_GUEST_TIMEOUT_S)
        except ValueError as e:  # a path that would leave the lease's guest routes
            await _answer(send, 400, {"detail": str(e)})
            return
        except FarmAPIError as e:  # the farm itself refused or could not reach the desktop
            await _answer(send, e.status or 502, {"detail": str(e)})
            return
        out = [(k.encode(), r.headers[k].encode("latin-1")) for k in _RESPONSE_HEADERS if k in r.headers]
        out.append((b"content-length", str(len(r.content)).encode()))
        await send({"type": "http.response.start", "status": r.status_code, "headers": out})
        await send({"type": "http.response.body", "body": r.content})


def _bind_loopback(tries: int = 8) -> socket.socket:
    """A listening socket on OSWorld's guest port (5000) at a random 127.x.y.z, else an ephemeral
    port on 127.0.0.1."""
    for _ in range(tries):
        host = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        try:
            return _listening(host, OSWORLD_GUEST_PORT)
        except OSError:
            continue
    return _listening("127.0.0.1", 0)


def _listening(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


async def _answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
