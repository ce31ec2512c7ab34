"""Lease latency: a lease answered from the warm pool vs a cold desktop start, in one run.

* warm: `POST /v1/desktops` against a farm with ready desktops (the release and the background
  reset that follows are not timed; the next lease waits until a desktop is ready again).
* cold: the sandbox provider starting a fresh desktop until its guest answers /v1/health
  (what a lease costs when the pool is empty), timed in this process.

Usage: python bench/lease_latency.py [N_WARM] [N_COLD]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from percentiles import median_ms, p90_ms  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from osfarm.config import FarmSettings  # noqa: E402
from osfarm.providers import make_provider  # noqa: E402
from osfarm.providers.base import DesktopSpec  # noqa: E402
from osfarm.testing.farms import running_farm  # noqa: E402


def warm_leases(n: int) -> list[float]:
    out: list[float] = []
    with running_farm(process=True, pool_min=2, pool_max=3, width=1920, height=1080, ready=2) as served:
        url, token = served.url, served.token
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
            for _ in range(n):
                _wait_ready(c, 1)
                t0 = time.perf_counter()
                r = c.post("/v1/desktops", json={})
                out.append(time.perf_counter() - t0)
                r.raise_for_status()
                c.delete(f"/v1/desktops/{r.json()['id']}").raise_for_status()
    return out


def _wait_ready(c: httpx.Client, k: int) -> None:
    deadline = time.monotonic() + 120
    while c.get("/v1/pool").json()["counts"].get("ready", 0) < k:
        if time.monotonic() > deadline:
            raise RuntimeError("pool did not refill in 120 s")
        time.sleep(0.02)


async def cold_starts(n: int) -> list[float]:
    settings = FarmSettings(state_dir=Path(tempfile.mkdtemp(prefix="ofc", dir="/tmp")))
    provider = make_provider(settings)
    await provider.reap_orphans()
    spec = DesktopSpec(width=settings.width, height=settings.height)
    out: list[float] = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            handle = await provider.start(f"c{i}", spec)
            out.append(time.perf_counter() - t0)
            await provider.stop(handle)
    finally:
        await provider.close()
    return out


def main(n_warm: int = 30, n_cold: int = 5) -> None:
    console = Console()
    with console.status("cold starts"):
        cold = asyncio.run(cold_starts(n_cold))
    with console.status("warm leases"):
        warm = warm_leases(n_warm)
    table = Table(title="lease latency (1920x1080 sandbox desktops)")
    for col in ("path", "n", "median ms", "p90 ms", "vs warm"):
        table.add_column(col, justify="left" if col == "path" else "right")
    wm = median_ms(warm)
    table.add_row("warm lease (POST /v1/desktops)", str(len(warm)), f"{wm:.1f}", f"{p90_ms(warm):.1f}", "1.0x")
    cm = median_ms(cold)
    table.add_row("cold desktop start (provider.start)", str(len(cold)), f"{cm:.1f}", f"{p90_ms(cold):.1f}",
                  f"{cm / wm:.0f}x slower")
    console.print(table)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n_warm", nargs="?", type=int, default=30, help="warm leases")
    ap.add_argument("n_cold", nargs="?", type=int, default=5, help="cold desktop starts")
    a = ap.parse_args()
    main(a.n_warm, a.n_cold)
