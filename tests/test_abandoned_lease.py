"""A lease request whose client hangs up while it waits does not take a desktop.

Real farm (uvicorn on loopback, the real pool and routes) over memory boxes: one desktop, held by
client A; client B asks for one with a long wait and gives up after half a second (its read
timeout closes the connection, as a killed worker's would); A releases. The desktop must go to
client C, who asks next, not to B's abandoned request: before the route watched for hang-ups, B's
handler kept waiting, was granted the desktop, and held it for nobody until the lease's TTL.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from osfarm.config import FarmSettings
from osfarm.farm.metrics import LEASES_ABANDONED
from osfarm.farm.server import FarmServer
from osfarm.testing.memory_provider import MemoryProvider

TOKEN = "abandon-token-1234"


async def test_a_lease_request_abandoned_while_waiting_does_not_take_the_desktop(tmp_path: Path) -> None:
    settings = FarmSettings(port=0, token=TOKEN, state_dir=tmp_path, pool_min=1, pool_max=1, lease_ttl_s=120)
    server = FarmServer(settings, MemoryProvider())
    await asyncio.to_thread(server.start, 60)
    abandoned_before = LEASES_ABANDONED._value.get()
    try:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"},
                                     timeout=30) as c:
            a = await c.post("/v1/desktops", json={"wait_s": 30})
            assert a.status_code == 201, a.text
            async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"},
                                         timeout=0.5) as quitter:
                try:
                    r = await quitter.post("/v1/desktops", json={"wait_s": 30, "owner": "quitter"})
                    raise AssertionError(f"the pool's only desktop is leased, yet B got {r.status_code}: {r.text}")
                except httpx.ReadTimeout:
                    pass  # B gives up; leaving the block closes its connection
            await asyncio.sleep(1.0)  # the route sees the hang-up within DISCONNECT_POLL_S
            assert (await c.delete(f"/v1/desktops/{a.json()['id']}")).status_code in (200, 204)
            cr = await c.post("/v1/desktops", json={"wait_s": 15, "owner": "c"})
            assert cr.status_code == 201, f"C did not get the released desktop: {cr.status_code} {cr.text}"
            pool = (await c.get("/v1/pool")).json()
            assert (pool["leases"], pool["waiting"]) == (1, 0), pool  # C's lease; no request left behind
        assert LEASES_ABANDONED._value.get() == abandoned_before + 1
    finally:
        await asyncio.to_thread(server.stop)
