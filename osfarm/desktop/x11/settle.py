"""``osfarm-settle``: wait inside a desktop until a window is painted and idle.

Task setups run it after starting an app (OSWorld's tasks sleep a fixed time instead): a window
whose title is already set can still be a blank rectangle for seconds on a loaded machine, and
keys typed into it then are lost or, worse, reordered (LibreOffice runs shortcuts such as Ctrl+Home
from its idle loop but inserts typed text at once).  "Painted" means the window's pixels are not
(almost) one colour; "idle" means they stopped changing for ``--quiet`` seconds and, with
``--process``, that the named processes used under 10% of a core over that time.

    osfarm-settle --window 'sales.xlsx - LibreOffice' --process soffice.bin [--timeout 60] [--quiet 0.5]

Exit status 0 when the window settled, 1 on timeout (with the reason on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable

import numpy as np
import psutil
from Xlib import display as xdisplay

from osfarm.desktop.x11.capture import ScreenCapture
from osfarm.desktop.x11.ewmh import client_geometry

BLANK_SHARE = 0.97  # a window whose most common colour covers more than this is not painted yet
IDLE_CPU = 0.10  # share of one core below which a process counts as idle


def total_cpu_seconds(procs: Iterable[psutil.Process]) -> float:
    """CPU time used so far by ``procs``; ones that exited meanwhile drop out."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def cpu_seconds(name: str) -> float:
    """CPU time used so far by every process called ``name``."""
    return total_cpu_seconds(p for p in psutil.process_iter(["name"]) if p.info["name"] == name)


def painted(region: np.ndarray) -> bool:
    flat = region[::4, ::4].reshape(-1, 4)[:, :3]  # every 16th pixel is plenty to tell
    packed = (flat[:, 0].astype(np.uint32) << 16) | (flat[:, 1].astype(np.uint32) << 8) | flat[:, 2]
    counts = np.bincount(np.unique(packed, return_inverse=True)[1])
    return counts.max() / packed.size < BLANK_SHARE


def wait_settled(title_part: str, timeout: float, quiet: float, cap: ScreenCapture,
                 process: str | None = None, x: xdisplay.Display | None = None) -> str | None:
    """None when settled, else why not. Each poll reads the window list on one X connection and
    grabs the window alone (no ``wmctrl`` process, no full-screen frame): a poll costs about a
    millisecond, so waiting for a starting app costs the desktop next to nothing."""
    own = x is None
    d = xdisplay.Display(cap.display_name) if x is None else x
    try:
        return _poll_settled(d, title_part, timeout, quiet, cap, process)
    finally:
        if own:
            d.close()


def _poll_settled(d: xdisplay.Display, title_part: str, timeout: float, quiet: float, cap: ScreenCapture,
                  process: str | None) -> str | None:
    deadline = time.monotonic() + timeout
    last: bytearray | None = None
    since = time.monotonic()
    cpu_at_since = 0.0
    why = f"no window titled *{title_part}*"
    while time.monotonic() < deadline:
        geo = client_geometry(d, title_part)
        if geo is not None:
            frame = cap.grab_region(*geo)
            now = time.monotonic()
            if frame is not None and frame.bgrx == last:  # unchanged (and painted when it was stored)
                if now - since >= quiet:
                    if not process:
                        return None
                    share = (cpu_seconds(process) - cpu_at_since) / (now - since)
                    if share < IDLE_CPU:
                        return None
                    since, cpu_at_since = now, cpu_seconds(process)
                    why = f"{process} still busy ({share:.0%} of a core)"
                    continue
                why = "window still changing"
            elif frame is not None and painted(frame.pixels()):
                last, since = frame.bgrx, now
                cpu_at_since = cpu_seconds(process) if process else 0.0
            else:
                last, why = None, "window not painted (one colour)"
        time.sleep(0.05)
    return why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="osfarm-settle", description=__doc__.splitlines()[0])
    ap.add_argument("--window", required=True, help="part of the window title")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--quiet", type=float, default=0.5, help="seconds without change")
    ap.add_argument("--process", help="also wait until processes of this name are idle (e.g. soffice.bin)")
    args = ap.parse_args(argv)
    if not os.environ.get("DISPLAY"):
        print("osfarm-settle: DISPLAY is not set", file=sys.stderr)
        return 2
    with ScreenCapture() as cap:
        why = wait_settled(args.window, args.timeout, args.quiet, cap, args.process)
    if why:
        print(f"osfarm-settle: gave up after {args.timeout:g} s: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
