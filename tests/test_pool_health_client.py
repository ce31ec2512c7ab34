"""The pool's health checks and the end of a desktop, on uvloop (the farm's ``server_loop: uvloop``,
and uvicorn's own default, which the farm ran on before it chose asyncio's loop), with real
sandbox boxes.

A desktop released (or reset, or removed) while the pool's health check of it is still waiting
for the guest's answer: the check's connection must not be closed under it. anyio's unix-socket
stream, under httpx, answers a close by resolving the pending read's future while uvloop still
polls the socket; the box's death then makes the socket readable and the poll resolves the
future a second time: "Exception in callback <built-in method set_result of _asyncio.Future>
... InvalidStateError" printed by every ``osfarm eval`` whose episode ended during a check.

The box runs a small guest (``STALLING_GUEST``) instead of the desktop session: it answers
``/v1/health`` until told ``POST /stall``, then takes health requests without answering (and
says so at ``GET /stalled``), so a check is surely in flight when the test releases the lease.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from osfarm.config import FarmSettings
from osfarm.farm.pool import LeasePool
from osfarm.providers.sandbox import SandboxProvider
from osfarm.providers.sandbox_layout import BOX_PYTHON

STALLING_GUEST = r"""
import json, os, socket, sys, threading
arg = lambda name: sys.argv[sys.argv.index(name) + 1]
stall, stalled = threading.Event(), threading.Event()
srv = socket.socket(socket.AF_UNIX)
srv.bind(arg("--socket"))
srv.listen(16)
with open(arg("--state-file"), "w") as f:  # listening: the farm may take the socket now
    json.dump({"pid": os.getpid()}, f)

def answer(conn, body):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))

def serve(conn):
    with conn:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
            head, buf = buf.split(b"\r\n\r\n", 1)
            method, path = head.split(b" ")[:2]
            if path == b"/stall":  # from now on health requests get no answer
                stall.set()
                answer(conn, b"{}")
            elif path == b"/stalled":  # has a health request been left waiting?
                answer(conn, json.dumps(stalled.is_set()).encode())
            elif stall.is_set():
                stalled.set()
                while conn.recv(65536):  # no answer, until the client or the box goes
                    pass
                return
            else:
                answer(conn, json.dumps({"status": "ok"}).encode())

while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

CYCLES = 24


async def _release_during_checks(state_dir: Path) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    assert type(loop).__module__.startswith("uvloop")
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    # cold: the test is about a box killed under a waiting check (a warm reset keeps it), and
    # STALLING_GUEST has no warm-reset routes (/v1/session/baseline).
    settings = FarmSettings(state_dir=state_dir, pool_min=1, pool_max=1, health_interval_s=0.02, start_timeout_s=30,
                            reset_mode="cold")
    pool = LeasePool(SandboxProvider(settings, launcher=[BOX_PYTHON, "-c", STALLING_GUEST]), settings)
    await pool.start()
    try:
        await pool.wait_warm(60)
        for _ in range(CYCLES):
            lease = await pool.lease(wait_s=60)
            async with lease.endpoint.client(timeout=10) as guest:
                (await guest.post("/stall")).raise_for_status()
                deadline = time.monotonic() + 10
                while not (await guest.get("/stalled")).json():  # a health check waits for its answer
                    assert time.monotonic() < deadline, "no health check reached the guest"
                    await asyncio.sleep(0.005)
            await pool.release(lease.id)  # reset: the box is killed under the waiting check
            await asyncio.sleep(0.2)
    finally:
        await pool.close()
    await asyncio.sleep(0.2)  # callbacks left over from the last box's end
    return errors


def test_release_during_a_health_check_leaves_no_loop_error() -> None:
    state_dir = Path(tempfile.mkdtemp(prefix="ofh", dir="/tmp"))
    try:
        errors = uvloop.run(_release_during_checks(state_dir))
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    assert errors == [], [f"{e.get('message')}: {e.get('exception')!r}" for e in errors]
