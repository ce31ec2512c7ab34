"""What the dashboard's live view costs a desktop: its CPU with a viewer at 10+ fps vs with nobody
watching, side by side in one run, and proof that nothing is captured while nobody watches.

One in-process farm (sandbox provider) serving /ui, one desktop showing a clock that changes
ten times a second (so every frame differs, as while an agent works). Phases alternate, each
``--seconds`` long: no viewer, one viewer, no viewer, two viewers (who share one capture), first
with the clock running (every frame differs: the worst case), then with a still screen (polled
slower until it changes). A viewer is a WebSocket client reading frames as a browser does.
For each phase: CPU of the desktop's processes (% of one core), frames
captured by the farm, frames received by the viewer per second, and the farm process's CPU
(which includes this script's client).

Usage: python bench/live_view.py [--seconds 10] [--rounds 2] [--size 1920x1080]
Target: the viewer adds under 10% of one core to the desktop; with no viewer nothing is captured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table
from websockets.asyncio.client import connect

from osfarm.config import FarmSettings
from osfarm.dashboard.app import mount
from osfarm.dashboard.state import Dashboard
from osfarm.farm.local import local_farm_settings
from osfarm.providers.sandbox import SANDBOX_ENV
from osfarm.testing.farms import running_farm

CLOCK = """
import time, tkinter as tk
root = tk.Tk(); root.geometry('900x300+200+200')
label = tk.Label(root, font=('DejaVu Sans Mono', 48)); label.pack(expand=True, fill='both')
def tick():
    label.config(text=time.strftime('%H:%M:%S') + ('.%02d' % (time.time() * 100 % 100)))
    root.after(100, tick)
tick(); root.mainloop()
"""


def box_processes(state_dir: Path) -> list[psutil.Process]:
    """The processes of the farm's sandbox boxes (they carry the box dir in their environment)."""
    found = []
    for p in psutil.process_iter():
        try:
            box = p.environ().get(SANDBOX_ENV)
        except psutil.Error:
            continue
        if box and box.startswith(str(state_dir)):
            found.append(p)
    return found


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class Viewer:
    """A WebSocket client on the live view, in its own thread and event loop."""

    def __init__(self, url: str, token: str, desktop_id: str, width: int, height: int):
        self.uri = url.replace("http://", "ws://") + f"/ui/desktops/{desktop_id}/live"
        self.token, self.size = token, (width, height)
        self.frames = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with connect(self.uri, additional_headers={"Authorization": f"Bearer {self.token}"},
                           max_size=None) as ws:
            await ws.send(f'{{"type": "view", "width": {self.size[0]}, "height": {self.size[1]}}}')
            while not self._stop.is_set():
                try:
                    msg = await asyncio.wait_for(ws.recv(), 0.5)
                except TimeoutError:
                    continue
                if isinstance(msg, bytes):
                    self.frames += 1
                    self.bytes += len(msg)

    def __enter__(self) -> Viewer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", default="1920x1080")
    args = ap.parse_args()
    w, h = (int(x) for x in args.size.split("x"))
    console = Console()
    dash = Dashboard(live_fps=10.0)
    state_dir = Path(tempfile.mkdtemp(prefix="oflv", dir=os.environ.get("OSFARM_STATE_DIR", "/tmp")))
    settings = local_farm_settings(envs=1, spares=0, width=w, height=h, state_dir=state_dir)
    rows = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, state_dir, True)
        run_phases(args, dash, settings, state_dir, rows)
    report(console, rows, w, h, args.seconds)


def run_phases(args: argparse.Namespace, dash: Dashboard, settings: FarmSettings, state_dir: Path,
               rows: list[tuple]) -> None:
    with running_farm(settings=settings, ui=mount(dash), start_timeout_s=settings.start_timeout_s + 30) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=60)
        lease = api.post("/v1/desktops", json={"ttl_s": 3600}).json()
        me = psutil.Process()
        phases = [("no viewer", 0), ("one viewer", 1), ("no viewer", 0), ("two viewers", 2)]
        plan = [(screen, name, n) for screen in ("changing", "still") for _ in range(args.rounds)
                for name, n in phases]
        for i, (screen, name, n) in enumerate(plan):
            if i == 0:  # a clock that changes 10 times a second: every frame differs
                api.post(f"/v1/desktops/{lease['id']}/guest/setup/launch",
                         json={"command": ["python3", "-c", CLOCK, "osfarm-bench-clock"]}).raise_for_status()
                time.sleep(3)
            elif screen == "still" and plan[i - 1][0] == "changing":
                api.post(f"/v1/desktops/{lease['id']}/guest/execute",
                         json={"command": "pkill -f osfarm-bench-clock", "shell": True})
                time.sleep(2)
            procs = box_processes(state_dir)
            c0, f0, m0, t0 = cpu_seconds(procs), dash.hub.captured if dash.hub else 0, me.cpu_times(), time.monotonic()
            viewers = [Viewer(server.url, server.token, lease["desktop_id"], 1280, 720) for _ in range(n)]
            with contextlib.ExitStack() as stack:
                for v in viewers:
                    stack.enter_context(v)
                time.sleep(args.seconds)
            dt = time.monotonic() - t0
            m1 = me.cpu_times()
            captured = (dash.hub.captured if dash.hub else 0) - f0
            if not n:
                assert captured == 0, f"{captured} frames captured while nobody watched"
            rows.append((f"{screen} screen, {name}", 100 * (cpu_seconds(procs) - c0) / dt, captured / dt,
                         viewers[0].frames / dt if viewers else None,
                         100 * ((m1.user + m1.system) - (m0.user + m0.system)) / dt, screen))
        api.delete(f"/v1/desktops/{lease['id']}")
        api.close()



def report(console: Console, rows: list[tuple], w: int, h: int, seconds: float) -> None:
    table = Table(title=f"live view cost, {w}x{h} desktop, {seconds:g} s per phase")
    for c in ("phase", "desktop CPU (% of a core)", "frames captured /s", "new frames to the viewer /s",
              "farm process CPU %"):
        table.add_column(c, justify="left" if c == "phase" else "right")
    for name, cpu, cap, fps, farm_cpu, _screen in rows:
        table.add_row(name, f"{cpu:.1f}", f"{cap:.1f}", f"{fps:.1f}" if fps is not None else "–", f"{farm_cpu:.1f}")
    console.print(table)
    for screen in ("changing", "still"):
        idle = [r[1] for r in rows if r[3] is None and r[5] == screen]
        for label in sorted({r[0] for r in rows if r[3] is not None and r[5] == screen}):
            watched = [r for r in rows if r[0] == label]
            extra = sum(r[1] for r in watched) / len(watched) - sum(idle) / len(idle)
            cap = sum(r[2] for r in watched) / len(watched)
            per_frame_ms = 10 * extra / cap if cap else 0.0
            console.print(f"{label}: +{extra:.1f}% of one core on the desktop vs no viewer, {cap:.1f} frames/s "
                          f"captured, {per_frame_ms:.1f} ms of desktop CPU a frame: {per_frame_ms:.1f}% at 10 fps "
                          f"(target < 10%: {'OK' if per_frame_ms < 10 else 'OVER'})", highlight=False)
    console.print(f"no viewer: {sum(r[2] for r in rows if r[3] is None):.0f} frames captured (must be 0)")


if __name__ == "__main__":
    main()
