"""A click plus a one-call JPEG observation under each action timing: osworld, settle, fast.

Two shapes of the same click, on one real desktop of one farm:
* computer_13: ``{"action_type": "CLICK", ...}`` in a step that returns the observation;
* pyautogui code: ``pyautogui.click(x, y)`` in a step that returns the observation.

``osworld`` sleeps pyautogui's 0.1 s after the click (and starts a new interpreter for code);
``settle`` waits for the screen's first answer and defers the rest of the wait (the longer quiet
after a click on an app, the cap after a closed window or a moved focus) to the next input event
(a child forked per code action); ``fast`` neither waits nor forks. The first table clicks a blank
part of the desktop, where nothing answers; the second clicks a Tk text field (an app: settle owes
the next event its longer quiet) and types a key into it (drawn at once).

Each timing runs its steps in bursts of ``BURST`` back to back, ``--think-ms`` apart (an agent's
policy call; default 0: replays), and the first step of a burst is not counted (it follows another
timing's step): with no think time what a settle step defers is paid by the next one and shows in
these figures. Rounds rotate the order of the timings. Prints medians, p90 and each timing's ratio
to osworld.

Usage: python bench/settle_step.py [ROUNDS] [--think-ms MS]
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


BURST = 4  # steps of one timing back to back; the first follows another timing's and is not counted


def measure(desk: RemoteDesktop, shapes: dict[str, Any], rounds: int,
            think_s: float = 0.0) -> dict[tuple[str, str], list[float]]:
    """Seconds per step (the action and its observation), per shape and timing: ``rounds``
    bursts of BURST steps, ``think_s`` apart, the burst's first step left out."""
    times: dict[tuple[str, str], list[float]] = {(s, t): [] for s in shapes for t in ACTION_TIMINGS}
    for action in shapes.values():  # warm-up: the interpreters start
        for timing in ACTION_TIMINGS:
            desk.step([action], timing=timing, observe=OBSERVE)
    for i in range(rounds):
        k = i % len(ACTION_TIMINGS)
        order = ACTION_TIMINGS[k:] + ACTION_TIMINGS[:k]
        for shape, action in shapes.items():
            for timing in order:
                for n in range(BURST):
                    time.sleep(think_s)
                    t0 = time.perf_counter()
                    sr = desk.step([action], timing=timing, observe=OBSERVE)
                    if n:
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


def main(rounds: int, think_ms: float) -> None:
    console = Console()
    think_s = think_ms / 1000
    with running_farm(process=True, pool_min=1, pool_max=1, width=1280, height=800, ready=1) as served, \
            Farm(served.url, served.token) as farm, farm.lease(ttl_s=1800, heartbeat=True) as desk:
        blank = measure(desk, {"computer_13": {"action_type": "CLICK", "parameters": {"x": 900, "y": 500}},
                               "pyautogui code": "pyautogui.click(900, 500)"}, rounds, think_s)
        desk.guest("POST", "/setup/launch", json={"command": ["python3", "-c", ENTRY]})
        desk.guest("POST", "/v1/wait_for_window", json={"title": "settle bench", "timeout": 30})
        time.sleep(1.0)
        desk.step([{"action_type": "CLICK", "parameters": {"x": 100, "y": 60}}])
        field = measure(desk, {"computer_13 click": {"action_type": "CLICK", "parameters": {"x": 100, "y": 60}},
                               "pyautogui code click": "pyautogui.click(100, 60)",
                               "computer_13 key": {"action_type": "TYPING", "parameters": {"text": "a"}},
                               "pyautogui code key": "pyautogui.write('a')"}, rounds, think_s)
    shape = f"{rounds} rounds of {BURST - 1} counted steps back to back, {think_ms:g} ms think time between steps"
    console.print(table(f"click on the blank desktop + JPEG observation, {shape}", blank))
    console.print(table(f"a click on / a key typed into a Tk text field (an app) + JPEG observation, {shape}", field))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=20, help="rounds (bursts) per timing and action")
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="sleep between steps, as an agent's policy call (default 0: back-to-back replays, "
                         "where settle's deferred wait is paid by the next step)")
    a = ap.parse_args()
    main(a.rounds, a.think_ms)
