"""Memory per idle desktop (summed RSS of the box's processes) and how many fit on this machine.

Starts K idle sandbox desktops at 1920x1080 side by side, sums the RSS of each box's processes,
and divides the machine's available memory by the mean. Usage: python bench/desktop_memory.py [K]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from osfarm.config import FarmSettings
from osfarm.providers import make_provider
from osfarm.providers.base import DesktopSpec


def rss_pss_mib(pids: list[int]) -> tuple[float, float]:
    """Summed RSS (counts shared libraries once per process) and PSS (shares them out)."""
    rss = pss = 0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += info.pss
    return rss / 2**20, pss / 2**20


async def measure(k: int) -> list[tuple[str, int, float, float]]:
    settings = FarmSettings(state_dir=Path(tempfile.mkdtemp(prefix="ofm", dir="/tmp")))
    provider = make_provider(settings)
    handles = []
    try:
        for i in range(k):
            handles.append(await provider.start(f"m{i}", DesktopSpec(width=1920, height=1080)))
        await asyncio.sleep(2)  # let start-up allocations settle before reading RSS
        return [(h.id, len(provider.pids(h)), *rss_pss_mib(provider.pids(h))) for h in handles]
    finally:
        for h in handles:
            await provider.stop(h)
        await provider.close()


def main(k: int = 3) -> None:
    rows = asyncio.run(measure(k))
    table = Table(title=f"idle 1920x1080 sandbox desktops ({k} side by side)")
    for col in ("desktop", "processes", "RSS MiB", "PSS MiB"):
        table.add_column(col, justify="right")
    for did, n, rss, pss in rows:
        table.add_row(did, str(n), f"{rss:.0f}", f"{pss:.0f}")
    rss = sum(r[2] for r in rows) / len(rows)
    pss = sum(r[3] for r in rows) / len(rows)
    avail = psutil.virtual_memory().available / 2**20
    Console().print(table)
    Console().print(
        f"per idle desktop: {rss:.0f} MiB summed RSS, {pss:.0f} MiB PSS; {avail:.0f} MiB available -> "
        f"{int(avail // rss)} (by RSS) to {int(avail // pss)} (by PSS) idle desktops fit; apps add more"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("desktops", nargs="?", type=int, default=3, help="desktops to start")
    main(ap.parse_args().desktops)
