"""Action timing: OSWorld's semantics (the default) vs the fast path, side by side in one run.

A real desktop runs a small Tk dialog with a "Find" and a "Replace" field. Like an app whose
click handling takes a moment (LibreOffice's Find & Replace under load, the issue's example),
it moves the keyboard focus to "Replace" CLICK_DELAY_MS after the click. Each round an agent-style
step runs the code block OSWorld agents write, ``pyautogui.click(<Replace>);
pyautogui.typewrite('abc')``, once per timing (interleaved, fields reset in between):

* ``osworld`` (default): the code runs as OSWorld runs it, a new interpreter with pyautogui's
  0.1 s pause after the click, so the dialog has moved the focus before the typing starts;
* ``fast``: one kept interpreter with ``PAUSE = 0``: the keys arrive before the focus moved and
  land in "Find" (the race the issue saw in a replay under load).

Then a typical 3-action step (click, type, hotkey) is timed in each mode: what the fast path
saves per step. Prints both tables. Usage: python bench/action_timing.py [ROUNDS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from percentiles import median_ms, p90_ms  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from osfarm.client import Farm, FarmUnreachableError, RemoteDesktop  # noqa: E402
from osfarm.testing.farms import running_farm  # noqa: E402

CLICK_DELAY_MS = 60
STATE = "/home/user/race.json"
DIALOG = r"""
import json, os, sys, tkinter as tk
STATE, DELAY = sys.argv[1], int(sys.argv[2])
root = tk.Tk(); root.title("Find and Replace"); root.geometry("+40+40")
tk.Label(root, text="Find").grid(row=0, column=0); tk.Label(root, text="Replace").grid(row=1, column=0)
find, repl = tk.Entry(root, width=30), tk.Entry(root, width=30)
find.grid(row=0, column=1, padx=8, pady=8); repl.grid(row=1, column=1, padx=8, pady=8)
def save(*_):
    tmp = STATE + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"find": find.get(), "replace": repl.get(), "geometry": geom()}, f)
    os.replace(tmp, STATE)
def geom():
    root.update_idletasks()
    return {"x": repl.winfo_rootx() + repl.winfo_width() // 2, "y": repl.winfo_rooty() + repl.winfo_height() // 2}
def clicked(_):  # the focus follows the click only once the app got round to it
    root.after(DELAY, repl.focus_set)
    return "break"
def reset():
    if os.path.exists(STATE + ".reset"):
        os.unlink(STATE + ".reset")
        find.delete(0, "end"); repl.delete(0, "end"); find.focus_force(); save()
    root.after(20, reset)
repl.bind("<Button-1>", clicked)
root.bind_all("<KeyRelease>", save)
root.after(200, save); root.after(20, reset)
root.mainloop()
"""


def read_state(desk: RemoteDesktop) -> dict:
    for _ in range(20):
        try:
            r = desk.guest("POST", "/file", data={"file_path": STATE}, check=False)
        except FarmUnreachableError:  # the file was replaced while being sent: read it again
            continue
        return json.loads(r.content) if r.status_code == 200 else {}
    raise RuntimeError(f"cannot read {STATE}")


def reset(desk: RemoteDesktop) -> dict:
    desk.guest("POST", "/setup/execute", json={"command": ["touch", STATE + ".reset"]})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = read_state(desk)
        if st and not st["find"] and not st["replace"]:
            r = desk.guest("POST", "/setup/execute", json={"command": ["test", "-e", STATE + ".reset"]})
            if r.json()["returncode"] != 0:
                return st
        time.sleep(0.05)
    raise RuntimeError("the dialog did not reset")


def main(rounds: int = 10) -> None:
    console = Console()
    with running_farm(process=True, pool_min=1, pool_max=1, width=1280, height=800, ready=1) as served:
        url, token = served.url, served.token
        with Farm(url, token) as farm, farm.lease(ttl_s=1800, heartbeat=True) as desk:
            desk.guest("POST", "/setup/launch", json={"command": [sys.executable, "-c", DIALOG, STATE,
                                                                 str(CLICK_DELAY_MS)]})
            deadline = time.monotonic() + 60
            while not read_state(desk).get("geometry"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the dialog did not start")
                time.sleep(0.2)
            g = read_state(desk)["geometry"]
            block = f"pyautogui.click({g['x']}, {g['y']}); pyautogui.typewrite('abc')"
            landed = {"osworld": 0, "fast": 0}
            to_find = {"osworld": 0, "fast": 0}
            with console.status("race rounds") as status:
                for i in range(rounds):
                    for timing in ("osworld", "fast") if i % 2 == 0 else ("fast", "osworld"):
                        reset(desk)
                        sr = desk.step([block], timing=timing)  # type: ignore[arg-type]
                        assert sr.results[0].ok, sr.results[0].error
                        time.sleep(0.5)  # let the deferred focus change and the saves happen
                        st = read_state(desk)
                        landed[timing] += st.get("replace") == "abc"
                        to_find[timing] += bool(st.get("find"))
                    status.update(f"race rounds: {i + 1}/{rounds}")

            step = [f"pyautogui.click({g['x']}, {g['y']})", "pyautogui.typewrite('hello')",
                    "pyautogui.hotkey('ctrl', 'a')"]
            times: dict[str, list[float]] = {"osworld": [], "fast": []}
            for timing in times:  # warm-up
                desk.step(step, timing=timing)  # type: ignore[arg-type]
            with console.status("timing steps") as status:
                for i in range(rounds):
                    for timing in ("osworld", "fast") if i % 2 == 0 else ("fast", "osworld"):
                        t0 = time.perf_counter()
                        desk.step(step, timing=timing)  # type: ignore[arg-type]
                        times[timing].append(time.perf_counter() - t0)
                    status.update(f"timing steps: {i + 1}/{rounds}")

    race = Table(title=f"'click Replace, then type' ({rounds} rounds; the dialog moves focus {CLICK_DELAY_MS} ms "
                       "after a click)")
    for col in ("timing", "text in Replace (as intended)", "keys typed into Find"):
        race.add_column(col, justify="left" if col == "timing" else "right")
    for timing in ("osworld", "fast"):
        race.add_row(timing + (" (default)" if timing == "osworld" else ""), f"{landed[timing]}/{rounds}",
                     f"{to_find[timing]}/{rounds}")
    console.print(race)
    cost = Table(title=f"one 3-action step (click, type, hotkey), {rounds} rounds, interleaved")
    for col in ("timing", "median ms", "p90 ms", "per action ms", "fast saves"):
        cost.add_column(col, justify="left" if col == "timing" else "right")
    base = median_ms(times["osworld"])
    for timing, ts in times.items():
        med = median_ms(ts)
        saves = "" if timing == "osworld" else f"{base - med:.0f} ms/step ({base / med:.1f}x)"
        cost.add_row(timing, f"{med:.0f}", f"{p90_ms(ts):.0f}", f"{med / len(step):.0f}", saves)
    console.print(cost)
    console.print(f"osworld mean {statistics.mean(times['osworld']) * 1000:.0f} ms, "
                  f"fast mean {statistics.mean(times['fast']) * 1000:.0f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=10, help="episodes per timing mode")
    main(ap.parse_args().rounds)
