"""The farm accepts a burst of new connections at once, and says how long it handled each request.

bench/load.py (500 clients) found 1% of leases taking ~30 s while the farm's own handling took
under 2 s: the time was spent in the listen queue. Under uvloop (which uvicorn picks when it is
installed) the farm accepted one connection per turn of its event loop, and a turn of a busy farm
loop is tens of ms; a burst of new connections (workers starting together) drained at ~20/s. The
farm now runs on the loop ``server_loop`` names, asyncio by default, which accepts every waiting
connection in one turn. The test counts turns, not seconds: the farm's loop is held while a burst
connects (the kernel queues them), then released, and after a few turns every connection of the
burst must be open in the server. Under uvloop about one per turn is.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import httpx
import pytest

from osfarm.config import FarmSettings
from osfarm.farm.server import FarmServer
from osfarm.http.server_timing import server_ms
from osfarm.testing.memory_provider import MemoryProvider

TOKEN = "accept-token-1234"
BURST = 64
TURNS = 8  # loop turns the burst gets: the accept, the connection tasks, and some slack


def _connect(port: int, n: int) -> list[socket.socket]:
    """n connections; each connect returns once the kernel has queued it for the farm to accept."""
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


async def _open_after_turns(server: FarmServer, turns: int) -> int:
    for _ in range(turns):
        await asyncio.sleep(0)
    return server.open_connections


@pytest.fixture
def farm(tmp_path: Path):
    settings = FarmSettings(port=0, token=TOKEN, state_dir=tmp_path, pool_min=0, pool_max=1)
    server = FarmServer(settings, MemoryProvider())
    server.start(60)
    try:
        yield server
    finally:
        server.stop()


def test_a_burst_of_new_connections_is_accepted_in_a_few_loop_turns(farm: FarmServer) -> None:
    loop = farm.state.loop
    assert loop is not None
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a busy farm: its loop does not turn while the burst connects
        held.set()
        release.wait(30)

    loop.call_soon_threadsafe(hold)
    assert held.wait(10)
    socks = _connect(farm.port, BURST)
    try:
        counted = asyncio.run_coroutine_threadsafe(_open_after_turns(farm, TURNS), loop)
        release.set()
        opened = counted.result(30)
        assert opened >= BURST, (f"{opened} of {BURST} queued connections accepted after {TURNS} turns of the "
                                 f"farm's loop ({farm.settings.server_loop}): the rest wait in the listen queue")
    finally:
        release.set()
        for s in socks:
            s.close()


def test_the_farms_connections_send_without_waiting_for_acks(farm: FarmServer) -> None:
    # asyncio's loop leaves Nagle's algorithm on for the sockets it accepts: uvicorn's answer head
    # and body went out as two sends, the body waiting for the client's delayed ACK (40 ms a request)
    with httpx.Client(base_url=farm.url, timeout=30) as c:
        assert c.get("/healthz").status_code == 200  # the connection stays open (keep-alive)

        async def nodelay() -> list[int]:
            return [p.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                    for p in farm._server.server_state.connections]

        loop = farm.state.loop
        assert loop is not None
        flags = asyncio.run_coroutine_threadsafe(nodelay(), loop).result(30)
    assert flags and all(flags), f"TCP_NODELAY per open connection on the {farm.settings.server_loop} loop: {flags}"


def test_every_answer_says_how_long_the_farm_handled_it(farm: FarmServer) -> None:
    with httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
        for r in (c.get("/v1/pool"), c.get("/healthz"), c.post("/v1/desktops", json={"wait_s": "soon"}),
                  httpx.get(f"{farm.url}/v1/pool", timeout=30)):
            dur = server_ms(r.headers.get("server-timing"))
            assert dur is not None and 0 <= dur < 30_000, (r.request.url, r.status_code, r.headers)


@pytest.mark.parametrize(("value", "ms"), [
    ("app;dur=12.5", 12.5),
    ("db;dur=3, app;desc=\"farm\";dur=7", 7.0),
    ("app", None),
    ("app;dur=fast", None),
    ("cache;dur=1", None),
    (None, None),
])
def test_server_ms_reads_the_app_duration(value: str | None, ms: float | None) -> None:
    assert server_ms(value) == ms


def test_server_loop_is_checked_by_name() -> None:
    with pytest.raises(ValueError, match="server_loop"):
        FarmSettings(server_loop="trio")
