"""The GNOME desktop beside the light one, measured side by side in one run (issue 27).

For each session (``light``: openbox + tint2; ``gnome``: GNOME Shell with the Ubuntu Dock) it starts
K idle 1920x1080 sandbox desktops one after the other, alternating the two kinds, and reports per
desktop: the cold start (``provider.start`` until the guest answers; for gnome that includes the
shell laying out its top bar and dock), idle CPU over a still screen, PSS of the box's processes,
how many such idle desktops the machine's available memory holds, and the median latency of a
computer_13 click + a JPEG observation and of an OSWorld PNG screenshot through the guest. The
last column is the gnome/light ratio. Usage: python bench/desktop_sessions.py [-k 2] [--idle 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from osfarm.config import FarmSettings
from osfarm.providers import make_provider
from osfarm.providers.base import DesktopHandle, DesktopSpec, Provider

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reset_latency import pss_mib  # noqa: E402  (PSS of a box's processes, as that bench counts it)

KINDS = ("light", "gnome")


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


async def latencies(handle: DesktopHandle, n: int) -> tuple[float, float]:
    """Median ms of a click + JPEG observation (native /v1/step, OSWorld's timing) and of a PNG
    screenshot (OSWorld's /screenshot)."""
    step, shot = [], []
    async with handle.endpoint.client() as c:
        body = {"actions": [{"action_type": "CLICK", "parameters": {"x": 960, "y": 600}}],
                "observe": {"format": "jpeg", "scale": 0.5, "windows": False, "cursor": False}}
        for _ in range(n):
            t0 = time.perf_counter()
            r = await c.post("/v1/step", json=body)
            r.raise_for_status()
            step.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            r = await c.get("/screenshot")
            r.raise_for_status()
            shot.append((time.perf_counter() - t0) * 1000)
    return statistics.median(step), statistics.median(shot)


async def one(provider: Provider, kind: str, i: int, idle_s: float, n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    handle = await provider.start(f"{kind[0]}{i}", DesktopSpec(width=1920, height=1080, desktop=kind))
    start_s = time.perf_counter() - t0
    try:
        await asyncio.sleep(3)  # start-up work done
        pids = provider.pids(handle)
        c0 = cpu_s(pids)
        await asyncio.sleep(idle_s)
        idle = (cpu_s(provider.pids(handle)) - c0) / idle_s
        pss = pss_mib(provider.pids(handle))
        step_ms, shot_ms = await latencies(handle, n)
    finally:
        await provider.stop(handle)
    return {"start_s": start_s, "idle_cpu": idle, "pss_mib": pss, "step_ms": step_ms, "shot_ms": shot_ms}


async def measure(k: int, idle_s: float, n: int) -> dict[str, list[dict[str, float]]]:
    settings = FarmSettings(state_dir=Path(tempfile.mkdtemp(prefix="ofs", dir="/tmp")))
    provider = make_provider(settings)
    out: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    try:
        for i in range(k):
            order = KINDS if i % 2 == 0 else tuple(reversed(KINDS))
            for kind in order:
                out[kind].append(await one(provider, kind, i, idle_s, n))
    finally:
        await provider.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", type=int, default=2, help="desktops of each kind (alternating)")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of still screen for the idle CPU")
    ap.add_argument("--steps", type=int, default=15, help="clicks + observations per desktop")
    args = ap.parse_args()
    res = asyncio.run(measure(args.k, args.idle, args.steps))
    avail = psutil.virtual_memory().available / 2**20
    mean = {kind: {m: statistics.fmean(r[m] for r in rows) for m in rows[0]} for kind, rows in res.items()}
    table = Table(title=f"idle 1920x1080 sandbox desktops, {args.k} of each kind, alternating")
    for col in ("metric", *KINDS, "gnome/light"):
        table.add_column(col, justify="right")
    rows = [("cold start (s)", "start_s", "{:.2f}"), ("idle CPU (CPU-s per s)", "idle_cpu", "{:.4f}"),
            ("PSS per desktop (MiB)", "pss_mib", "{:.0f}"),
            ("click + JPEG observation, median (ms)", "step_ms", "{:.1f}"),
            ("PNG screenshot, median (ms)", "shot_ms", "{:.1f}")]
    for label, key, fmt in rows:
        light, gnome = mean["light"][key], mean["gnome"][key]
        table.add_row(label, fmt.format(light), fmt.format(gnome), f"{gnome / light:.2f}x" if light else "-")
    fit = {kind: int(avail // mean[kind]["pss_mib"]) for kind in KINDS}
    table.add_row(f"idle desktops in {avail / 1024:.1f} GiB available (by PSS)", str(fit["light"]),
                  str(fit["gnome"]), f"{fit['gnome'] / fit['light']:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
