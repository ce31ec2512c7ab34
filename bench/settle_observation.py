"""What a step's observation misses under each action timing: osworld, settle, fast.

``settle`` returns a step once the app's first repaint has been quiet 12 ms and leaves the rest
of the wait (the 70 ms quiet after a click on an app, OSWorld's whole 0.1 s after a command key or
a moved focus) to the next input event (osfarm/desktop/x11/input_settle.py). The observation the
step returns may therefore show the app before it finished answering: the Tk race dialog moves its
focus 30-60 ms after a click, a dialog maps after a key's first repaint. ``osworld`` observes after
pyautogui's 0.1 s pause; ``fast`` at once.

On one real desktop of one farm, for the first action of each race of bench/timing_races.py (a
click on the Tk dialog's Replace field, on the unfocused GTK window's field, on LibreOffice's Replace
field; ctrl+H opening Writer's Find & Replace; ctrl+L in Chromium; a click on the unfocused terminal),
per round and per timing (rotated as bench/action_timing.py does), per shape (a pyautogui code action
and the computer_13 CLICK / HOTKEY):

1. the race's ``prepare`` puts the app back in its starting state (paced the OSWorld way);
2. one step runs that single action and returns its observation (lossless PNG; the pointer is
   drawn in, as in OSWorld's screenshots, at the same place in every picture of a sample: only a
   changed pointer shape, an app's answer too, differs);
3. with no input event after it, two screenshots at about +350 ms and +700 ms after the step
   returned (``--settled-at``) are the "settled" screen; if those two differ (an animation still
   running, a caret blinking where the bench could not stop it: see NO_BLINK_GNOME) the sample is
   unstable and counted apart, not judged;
4. the observation missed something when it differs from the settled screen: the bounding box of
   the differing pixels tells a caret (at most CARET_W px wide) from a moved focus ring or a
   dialog that appeared, and the share of those pixels where the observation still equals a
   screenshot taken before the step ("old") tells an answer missing altogether (100%) from one
   caught halfway (a focus ring fading in: near 0%). The top bar's clock is masked.

Prints one table: case x shape x timing -> missed / stable samples (how many of the misses are
caret-sized), the median bounding box, differing pixels and old share of the misses, the median step time; what
changed in the unstable samples; the median step time per timing over all cases. With ``--save
DIR`` the first miss per case, shape and timing is saved as a pair of cropped PNGs
(``...-observation.png``, ``...-settled.png``), the first unstable one as ``unstable-...-settled-a/b.png``,
and one whole settled screen (``screen.png``, the clock masked) to place them.

With ``--settle-s 1`` the step's observation waits for a still screen and idle apps as osfarm's
episodes (TaskEnv) take it: what an agent run by ``osfarm eval`` or ``osfarm train`` sees.

Usage: python bench/settle_observation.py [ROUNDS] [--cases tk,gtk,...] [--save DIR] [--settled-at 0.35,0.7]
       [--settle-s 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from action_timing import TIMINGS, rotated  # noqa: E402
from percentiles import median_ms  # noqa: E402
from PIL import Image, ImageChops  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from timing_races import (  # noqa: E402
    PYTHON,
    Chromium,
    FieldsApp,
    Race,
    Terminal,
    WriterDialogOpens,
    WriterFindReplace,
    execute,
    select_races,
)

from osfarm.client import Farm, RemoteDesktop, screenshot_image  # noqa: E402
from osfarm.schema.guest import ActionTiming  # noqa: E402
from osfarm.testing.farms import running_farm  # noqa: E402

OBSERVE = {"format": "png", "windows": False, "cursor": False}  # cursor: its position, not whether it is drawn
SETTLED_AT_S = (0.35, 0.7)  # after the step returned: the settled screen, taken twice
CLOCK = (540, 0, 740, 34)  # the top bar's clock on the 1280x800 GNOME screen (left, top, right, bottom)
CARET_W = 4  # a difference at most this wide (and CARET_H tall) is a caret (blink or move in place)
CARET_H = 40
CROP_PAD = 40  # pixels around a miss's bounding box in the saved crops
SHAPES = ("pyautogui code", "computer_13")
# Carets that blink make the settled screen differ from itself 350 ms later (an unstable sample,
# not judged). Before the apps start, blinking is turned off where the desktop lets it be:
# GTK/GNOME apps through gsettings, Tk's entries through the X resources Tk reads at its start.
# A still caret still shows where the focus is; only its blinking goes.
NO_BLINK_GNOME = ("gsettings", "set", "org.gnome.desktop.interface", "cursor-blink", "false")
NO_BLINK_TK = r"""
from Xlib import Xatom, display
d = display.Display(); root = d.screen().root
rm = d.intern_atom("RESOURCE_MANAGER")
p = root.get_full_property(rm, Xatom.STRING)
old = p.value if p else b""
old = old.encode() if isinstance(old, str) else bytes(old)
root.change_property(rm, Xatom.STRING, 8, old + b"\n*insertOffTime: 0\n"); d.sync()
"""


@dataclass
class FirstAction:
    """The first action of a race, in both shapes an agent may send it."""

    what: str
    code: str
    computer_13: dict[str, Any]


def click(what: str, x: int, y: int) -> FirstAction:
    return FirstAction(what, f"pyautogui.click({x}, {y})",
                       {"action_type": "CLICK", "parameters": {"x": x, "y": y}})


def hotkey(what: str, *keys: str) -> FirstAction:
    return FirstAction(what, f"pyautogui.hotkey({', '.join(repr(k) for k in keys)})",
                       {"action_type": "HOTKEY", "parameters": {"keys": list(keys)}})


def first_action(race: Race) -> FirstAction:
    """The race's first action (its ``code`` without the typing), known once it is set up."""
    if isinstance(race, FieldsApp):
        return click("click the Replace field", race.at["x"], race.at["y"])
    if isinstance(race, WriterDialogOpens):  # before its base class: it opens the dialog instead
        return hotkey("ctrl+H opens Find & Replace", "ctrl", "h")
    if isinstance(race, WriterFindReplace):
        return click("click the Replace field", *race.repl)
    if isinstance(race, Chromium):
        return hotkey("ctrl+L", "ctrl", "l")
    if isinstance(race, Terminal):
        return click("click the unfocused terminal", race.a["x"], race.a["y"])
    raise ValueError(f"no first action known for the race {race.name!r}")


def masked(img: Image.Image) -> Image.Image:
    out = img.convert("RGB")
    out.paste((0, 0, 0), CLOCK)
    return out


def diff_box(a: Image.Image, b: Image.Image) -> tuple[int, int, int, int] | None:
    """The bounding box of the pixels where ``a`` and ``b`` differ, None where they are equal."""
    return ImageChops.difference(a, b).getbbox()


def missed_pixels(before: Image.Image, obs: Image.Image, settled: Image.Image) -> tuple[int, float]:
    """How many pixels of the observation differ from the settled screen, and the share of them
    where it still shows the screen from before the action: 1.0 when the app's answer there is
    missing altogether (no focus ring yet, no dialog), near 0 when the observation caught it
    halfway (a focus ring fading in)."""
    o = np.asarray(obs, dtype=np.int16)
    missed = np.abs(o - np.asarray(settled, dtype=np.int16)).sum(axis=2) > 0
    unchanged = np.abs(o - np.asarray(before, dtype=np.int16)).sum(axis=2) == 0
    return int(missed.sum()), float((missed & unchanged).sum() / max(1, missed.sum()))


def area(box: tuple[int, int, int, int]) -> int:
    return (box[2] - box[0]) * (box[3] - box[1])


def caret_sized(box: tuple[int, int, int, int]) -> bool:
    return box[2] - box[0] <= CARET_W and box[3] - box[1] <= CARET_H


@dataclass
class Cell:
    """The samples of one case, shape and timing."""

    step_s: list[float] = field(default_factory=list)
    stable: int = 0
    unstable: list[tuple[int, int, int, int]] = field(default_factory=list)  # what changed between the settled two
    misses: list[tuple[int, int, int, int]] = field(default_factory=list)
    old_share: list[float] = field(default_factory=list)  # per miss: see missed_pixels()
    missed_px: list[int] = field(default_factory=list)  # per miss: how many pixels differ
    saved: bool = False


def save_pair(where: Path, stem: str, pair: dict[str, Image.Image], box: tuple[int, int, int, int]) -> None:
    """Save each image of ``pair`` (suffix: image) cropped around ``box``."""
    first = next(iter(pair.values()))
    crop = (max(0, box[0] - CROP_PAD), max(0, box[1] - CROP_PAD),
            min(first.width, box[2] + CROP_PAD), min(first.height, box[3] + CROP_PAD))
    where.mkdir(parents=True, exist_ok=True)
    for suffix, img in pair.items():
        img.crop(crop).save(where / f"{stem}-{suffix}.png")


def sample(desk: RemoteDesktop, race: Race, action: Any, timing: ActionTiming, cell: Cell,
           settled_at_s: tuple[float, float], save: Path | None, stem: str, settle_s: float = 0.0) -> None:
    race.prepare(desk)
    before = masked(screenshot_image(desk.observe(**OBSERVE)))
    t0 = time.perf_counter()
    res = desk.step([action], timing=timing, observe={**OBSERVE, "settle_s": settle_s})
    returned = time.perf_counter()
    if not res.results[0].ok:
        raise RuntimeError(f"{timing}: {res.results[0].error}")
    cell.step_s.append(returned - t0)
    assert res.observation is not None
    settled = []
    for at in settled_at_s:  # an observation is no input event: nothing is paid or sent here
        time.sleep(max(0.0, returned + at - time.perf_counter()))
        settled.append(masked(screenshot_image(desk.observe(**OBSERVE))))
    if save is not None and not (save / "screen.png").exists():  # where the crops are, the clock masked
        save.mkdir(parents=True, exist_ok=True)
        settled[1].save(save / "screen.png")
    moving = diff_box(*settled)
    if moving is not None:
        if save is not None and not cell.unstable:
            save_pair(save, f"unstable-{stem}", {"settled-a": settled[0], "settled-b": settled[1]}, moving)
        cell.unstable.append(moving)
        return
    cell.stable += 1
    obs = masked(screenshot_image(res.observation))
    box = diff_box(obs, settled[1])
    if box is None:
        return
    cell.misses.append(box)
    px, old = missed_pixels(before, obs, settled[1])
    cell.missed_px.append(px)
    cell.old_share.append(old)
    if save is not None and not cell.saved:
        save_pair(save, stem, {"observation": obs, "settled": settled[1]}, box)
        cell.saved = True


def run_case(desk: RemoteDesktop, race: Race, rounds: int, settled_at_s: tuple[float, float], save: Path | None,
             console: Console, settle_s: float = 0.0
             ) -> tuple[FirstAction | None, dict[tuple[str, ActionTiming], Cell], str | None]:
    cells = {(s, t): Cell() for s in SHAPES for t in TIMINGS}
    try:
        race.setup(desk)
        first = first_action(race)
    except Exception as e:  # an app that does not start is a row of the table, not the end of the bench
        return None, cells, f"setup: {type(e).__name__}: {e}"[:160]
    slug = race.name.lower().replace(" ", "-").replace("&", "")
    try:
        with console.status(race.name) as status:
            for i in range(rounds):
                for timing in rotated(i):
                    for shape, action in zip(SHAPES, (first.code, first.computer_13), strict=True):
                        sample(desk, race, action, timing, cells[(shape, timing)], settled_at_s, save,
                               f"{slug}-{shape.replace(' ', '-')}-{timing}", settle_s)
                status.update(f"{race.name}: {i + 1}/{rounds}")
    except Exception as e:  # the samples so far still count
        return first, cells, f"{type(e).__name__}: {e}"[:160]
    finally:
        race.close(desk)
    return first, cells, None


def miss_text(cell: Cell) -> str:
    carets = sum(caret_sized(b) for b in cell.misses)
    text = f"{len(cell.misses)}/{cell.stable}"
    if carets:
        text += f" ({carets} caret)"
    if cell.unstable:
        text += f" +{len(cell.unstable)}u"
    return text


def box_text(cell: Cell) -> str:
    if not cell.misses:
        return "-"
    box = sorted(cell.misses, key=area)[len(cell.misses) // 2]  # the median miss by area
    old = sorted(cell.old_share)[len(cell.old_share) // 2]
    px = sorted(cell.missed_px)[len(cell.missed_px) // 2]
    return f"{box[2] - box[0]}x{box[3] - box[1]} {px}px {old:.0%}old"


def main(rounds: int, only: list[str] | None, save: Path | None,
         settled_at_s: tuple[float, float] = SETTLED_AT_S, settle_s: float = 0.0) -> None:
    console = Console(width=230)
    races = select_races(only)
    outcomes = []
    t_start = time.monotonic()
    with running_farm(process=True, pool_min=1, pool_max=1, width=1280, height=800, ready=1) as served:
        with Farm(served.url, served.token) as farm, farm.lease(ttl_s=1800, heartbeat=True) as desk:
            for command in (NO_BLINK_GNOME, (PYTHON, "-c", NO_BLINK_TK)):
                r = execute(desk, *command)
                if r.get("returncode") != 0:
                    console.print(f"[yellow]carets may blink: {command[0]}: {r}")
            for race in races:
                t0 = time.monotonic()
                outcomes.append((race, *run_case(desk, race, rounds, settled_at_s, save, console, settle_s)))
                console.print(f"{race.name}: {time.monotonic() - t0:.0f} s")

    table = Table(title=f"what the step's observation misses vs the screen +{settled_at_s[0]:g}/+{settled_at_s[1]:g} s "
                        f"later ({rounds} rounds, the step's observation with settle_s {settle_s:g}, "
                        "timings rotated; missed/stable samples, +Nu unstable; "
                        "bbox: the median miss's bounding box (by area), the median count of differing pixels and "
                        "share of them still showing the screen before the action (old); median step ms incl. the "
                        "PNG observation)")
    table.add_column("case")
    table.add_column("shape")
    for t in TIMINGS:
        table.add_column(f"{t} missed", justify="right")
        table.add_column(f"{t} bbox", justify="right")
        table.add_column(f"{t} ms", justify="right")
    for race, first, cells, _ in outcomes:
        label = f"{race.name}: {first.what}" if first else race.name
        for shape in SHAPES:
            row = [label if shape == SHAPES[0] else "", shape]
            for t in TIMINGS:
                c = cells[(shape, t)]
                row += [miss_text(c), box_text(c), f"{median_ms(c.step_s):.0f}" if c.step_s else "-"]
            table.add_row(*row)
    for shape in SHAPES:
        row = ["all cases" if shape == SHAPES[0] else "", shape]
        for t in TIMINGS:
            cs = [cells[(shape, t)] for _, _, cells, _ in outcomes]
            total = Cell(step_s=[s for c in cs for s in c.step_s], stable=sum(c.stable for c in cs),
                         unstable=[b for c in cs for b in c.unstable], misses=[b for c in cs for b in c.misses],
                         old_share=[o for c in cs for o in c.old_share], missed_px=[p for c in cs for p in c.missed_px])
            row += [miss_text(total), box_text(total),
                    f"{median_ms(total.step_s):.0f}" if total.step_s else "-"]
        table.add_row(*row, end_section=shape == SHAPES[-1])
    console.print(table)
    for race, _, cells, error in outcomes:
        moving = Counter(b for c in cells.values() for b in c.unstable)
        if moving:  # what kept changing on the settled screen, so these samples could not be judged
            console.print(f"{race.name}: unstable samples changed " + ", ".join(
                f"{b[2] - b[0]}x{b[3] - b[1]} at ({b[0]}, {b[1]}) {n}x" for b, n in moving.most_common(3)))
        if error:
            console.print(f"[yellow]{race.name} stopped: {error}")
    steps = {t: [s for _, _, cells, _ in outcomes for sh in SHAPES for s in cells[(sh, t)].step_s] for t in TIMINGS}
    console.print("median step over all cases and shapes: "
                  + ", ".join(f"{t} {median_ms(v):.0f} ms" for t, v in steps.items() if v)
                  + f"; bench {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=6, help="rounds per case (each: every timing, both shapes)")
    ap.add_argument("--cases", default=None,
                    help="comma-separated words of race names to run (e.g. tk,gtk,libreoffice,window,chromium,"
                         "terminal); default: all. The Tk dialog always runs (the GTK case uses it), and "
                         "'window' brings the LibreOffice dialog's Writer")
    ap.add_argument("--save", type=Path, default=None,
                    help="save the first miss of each case, shape and timing as cropped PNG pairs here")
    ap.add_argument("--settled-at", default=",".join(f"{t:g}" for t in SETTLED_AT_S),
                    help="when the two settled screenshots are taken, seconds after the step returned "
                         "(default %(default)s; later for apps that are still drawing then, e.g. 1,1.6)")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="the step's observation waits up to this long for the screen to go still and the apps "
                         "idle, as osfarm's episodes ask (osfarm.env.SETTLE_S, 1.0); default %(default)s: the "
                         "step's own observation as the API returns it")
    a = ap.parse_args()
    at = tuple(float(t) for t in a.settled_at.split(","))
    if len(at) != 2 or not 0 < at[0] < at[1]:
        ap.error(f"--settled-at: two increasing times in seconds, got {a.settled_at!r}")
    main(a.rounds, a.cases.split(",") if a.cases else None, a.save, (at[0], at[1]), a.settle_s)
