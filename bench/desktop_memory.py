"""Memory per idle desktop (summed RSS of the box's processes) and how many fit on this machine.

Starts K idle sandbox desktops at 1920x1080 side by side, sums the RSS of each box's processes,
and divides the machine's available memory by the mean. Usage: python bench/desktop_memory.py [K]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from osfarm.config import FarmSettings
from osfarm.providers import make_provider
from osfarm.providers.base import DesktopSpec


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


async def measure(k: int) -> list[tuple[str, int, float]]:
    settings = FarmSettings(state_dir=Path(tempfile.mkdtemp(prefix="ofm", dir="/tmp")))
    provider = make_provider(settings)
    handles = []
    try:
        for i in range(k):
            handles.append(await provider.start(f"m{i}", DesktopSpec(width=1920, height=1080)))
        await asyncio.sleep(2)  # let start-up allocations settle before reading RSS
        return [(h.id, len(provider.pids(h)), rss_mib(provider.pids(h))) for h in handles]
    finally:
        for h in handles:
            await provider.stop(h)
        await provider.close()


def main(k: int = 3) -> None:
    rows = asyncio.run(measure(k))
    table = Table(title=f"idle 1920x1080 sandbox desktops ({k} side by side)")
    for col in ("desktop", "processes", "RSS MiB"):
        table.add_column(col, justify="right")
    for did, n, mib in rows:
        table.add_row(did, str(n), f"{mib:.0f}")
    mean = sum(r[2] for r in rows) / len(rows)
    avail = psutil.virtual_memory().available / 2**20
    Console().print(table)
    Console().print(f"mean {mean:.0f} MiB per idle desktop; {avail:.0f} MiB available -> about {int(avail // mean)} idle desktops fit (apps add more)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
