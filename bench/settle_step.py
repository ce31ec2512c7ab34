"""A click plus a one-call JPEG observation under each action timing: osworld, settle, fast.

Two shapes of the same click, on one real desktop of one farm, interleaved round by round:
* computer_13: ``{"action_type": "CLICK", ...}`` in a step that returns the observation;
* pyautogui code: ``pyautogui.click(x, y)`` in a step that returns the observation.

``osworld`` sleeps pyautogui's 0.1 s after the click (and starts a new interpreter for code);
``settle`` waits for the screen's answer, capped at that 0.1 s (a child forked per code action);
``fast`` neither waits nor forks. The click lands on a blank part of the desktop, where nothing
answers: the settle wait's worst case, its cap. A second table types a key into an Tk text field, which
draws it at once. Prints medians, p90 and each timing's ratio to osworld.

Usage: python bench/settle_step.py [ROUNDS]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from percentiles import median_ms, p90_ms  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from osfarm.client import Farm, RemoteDesktop  # noqa: E402
from osfarm.schema.guest import ACTION_TIMINGS  # noqa: E402
from osfarm.testing.farms import running_farm  # noqa: E402

# a text field, as the desktop's python3 draws it (Tk): it draws a typed character at once
ENTRY = ("import tkinter as tk; r = tk.Tk(); r.title('settle bench'); r.geometry('600x80+0+0'); "
         "e = tk.Entry(r); e.pack(fill='both', expand=True); e.focus_force(); r.mainloop()")
OBSERVE = {"format": "jpeg", "windows": False, "cursor": False}


def measure(desk: RemoteDesktop, shapes: dict[str, Any], rounds: int) -> dict[tuple[str, str], list[float]]:
    times: dict[tuple[str, str], list[float]] = {(s, t): [] for s in shapes for t in ACTION_TIMINGS}
    for action in shapes.values():  # warm-up: the interpreters start
        for timing in ACTION_TIMINGS:
            desk.step([action], timing=timing, observe=OBSERVE)
    for i in range(rounds):
        order = ACTION_TIMINGS if i % 2 == 0 else tuple(reversed(ACTION_TIMINGS))
        for shape, action in shapes.items():
            for timing in order:
                t0 = time.perf_counter()
                sr = desk.step([action], timing=timing, observe=OBSERVE)
                times[(shape, timing)].append(time.perf_counter() - t0)
                assert sr.results[0].ok, sr.results[0].error
    return times


def table(title: str, times: dict[tuple[str, str], list[float]]) -> Table:
    t = Table(title=title)
    for col in ("action", "timing", "median ms", "p90 ms", "vs osworld"):
        t.add_column(col, justify="left" if col in ("action", "timing") else "right")
    for (shape, timing), ts in times.items():
        base = median_ms(times[(shape, "osworld")])
        t.add_row(shape, timing, f"{median_ms(ts):.1f}", f"{p90_ms(ts):.1f}", f"{median_ms(ts) / base:.2f}x")
    return t


def main(rounds: int) -> None:
    console = Console()
    with running_farm(process=True, pool_min=1, pool_max=1, width=1280, height=800, ready=1) as served, \
            Farm(served.url, served.token) as farm, farm.lease(ttl_s=1800, heartbeat=True) as desk:
        blank = measure(desk, {"computer_13": {"action_type": "CLICK", "parameters": {"x": 900, "y": 500}},
                               "pyautogui code": "pyautogui.click(900, 500)"}, rounds)
        desk.guest("POST", "/setup/launch", json={"command": ["python3", "-c", ENTRY]})
        desk.guest("POST", "/v1/wait_for_window", json={"title": "settle bench", "timeout": 30})
        time.sleep(1.0)
        desk.step([{"action_type": "CLICK", "parameters": {"x": 100, "y": 60}}])
        field = measure(desk, {"computer_13": {"action_type": "TYPING", "parameters": {"text": "a"}},
                               "pyautogui code": "pyautogui.write('a')"}, rounds)
    console.print(table(f"click on the blank desktop + JPEG observation, {rounds} rounds interleaved", blank))
    console.print(table(f"a key typed into an Tk text field (it draws the character at once) + JPEG observation, "
                        f"{rounds} rounds interleaved", field))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=20, help="rounds per timing and action")
    main(ap.parse_args().rounds)
