"""A click followed by a 1920x1080 screenshot: osfarm's native path vs an OSWorld-style path.

Both paths drive the same real desktop through the same farm, interleaved in one run:
* OSWorld-style: `POST /execute` of `python -c "import pyautogui; ...; pyautogui.click(x, y)"`
  (a new interpreter per action, pyautogui's default 0.1 s PAUSE), then `GET /screenshot`
  (PNG, Pillow's default compression), both through the farm's guest passthrough.
* osfarm: `POST /v1/desktops/{id}/step` (CLICK through XTest in the guest process), then
  `GET .../screenshot` as JPEG or PNG; and the one-call variant (step with an observation).

Prints medians and the speedup over the OSWorld-style path. Usage: python bench/step_latency.py [N]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from percentiles import median_ms, p90_ms  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from osfarm.client import Farm  # noqa: E402
from osfarm.testing.farms import running_farm  # noqa: E402

# The desktop's python3 (the agent's, with pyautogui), as OSWorld's tasks run it: not this
# interpreter, which is not in the box.
PYTHON = "python3"


def main(n: int = 20) -> None:
    console = Console()
    with running_farm(process=True, pool_min=1, pool_max=1, width=1920, height=1080, ready=1) as served:
        url, token = served.url, served.token
        with Farm(url, token) as farm, farm.lease(ttl_s=900) as desk:
            desk.guest("POST", "/setup/launch", json={"command": ["xfce4-terminal", "--disable-server"]})
            desk.step({"action_type": "WAIT"})

            def click(x: int, y: int) -> dict:
                return {"action_type": "CLICK", "parameters": {"x": x, "y": y}}

            def osworld(x: int, y: int) -> None:
                code = f"import pyautogui; import time; pyautogui.FAILSAFE = False; pyautogui.click({x}, {y})"
                r = desk.guest("POST", "/execute", json={"command": [PYTHON, "-c", code], "shell": False})
                assert r.status_code == 200 and r.json()["returncode"] == 0, r.text
                shot = desk.guest("GET", "/screenshot")
                assert shot.content[:4] == b"\x89PNG"

            def native_jpeg(x: int, y: int) -> None:
                desk.step(click(x, y))
                assert desk.screenshot(fmt="jpeg")[:2] == b"\xff\xd8"

            def native_png(x: int, y: int) -> None:
                desk.step(click(x, y))
                assert desk.screenshot(fmt="png")[:4] == b"\x89PNG"

            def native_one_call(x: int, y: int) -> None:
                res = desk.step(click(x, y), observe={"format": "jpeg", "windows": False, "cursor": False})
                assert res.observation is not None and res.observation.screenshot

            paths = {
                "OSWorld-style (python -c pyautogui + PNG)": osworld,
                "osfarm step + JPEG screenshot": native_jpeg,
                "osfarm step + PNG screenshot": native_png,
                "osfarm step with JPEG observation (1 call)": native_one_call,
            }
            times: dict[str, list[float]] = {k: [] for k in paths}
            rng = random.Random(0)
            for fn in paths.values():  # warm-up: imports, connections, page cache
                fn(900, 500)
            with console.status("measuring") as status:
                for i in range(n):
                    order = list(paths.items())
                    rng.shuffle(order)  # interleaved so machine noise hits every path alike
                    for name, fn in order:
                        x, y = rng.randrange(200, 1700), rng.randrange(200, 900)
                        t0 = time.perf_counter()
                        fn(x, y)
                        times[name].append(time.perf_counter() - t0)
                    status.update(f"measuring: round {i + 1}/{n}")

    base = median_ms(times["OSWorld-style (python -c pyautogui + PNG)"])
    table = Table(title=f"click + screenshot at 1920x1080, {n} rounds, interleaved")
    for col in ("path", "median ms", "p90 ms", "speedup vs OSWorld-style"):
        table.add_column(col, justify="right" if col != "path" else "left")
    for name, ts in times.items():
        med = median_ms(ts)
        table.add_row(name, f"{med:.1f}", f"{p90_ms(ts):.1f}", f"{base / med:.1f}x")
    console.print(table)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=20, help="interleaved rounds per path")
    main(ap.parse_args().rounds)
