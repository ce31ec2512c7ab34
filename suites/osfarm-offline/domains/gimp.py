"""gimp: image edits in GIMP 2.10 exported with File > Export As, and one preference saved to
gimprc.

The reference solutions reach menu items with the keyboard (Alt+<mnemonic>, then mnemonics or
arrow keys) and fill dialogs by Tab and typing, so they do not depend on where a dialog maps.
GIMP's first start in a fresh home takes several seconds: setup polls for the image window.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

from PIL import Image, ImageDraw
from suitekit import (
    DONE,
    activate,
    await_window,
    cmdline,
    dl,
    execute,
    gold,
    hotkey,
    launch,
    pause,
    poll,
    press,
    rule,
    type_text,
    vm_file,
    wait_window,
)

MIRROR = "0f5d2a10-0000-4000-8000-000000000501"
SCALE = "0f5d2a10-0000-4000-8000-000000000502"
JPEG = "0f5d2a10-0000-4000-8000-000000000503"
UNDO = "0f5d2a10-0000-4000-8000-000000000504"
DARKEN = "0f5d2a10-0000-4000-8000-000000000505"
SATURATE = "0f5d2a10-0000-4000-8000-000000000506"
INFEASIBLE = "0f5d2a10-0000-4000-8000-000000000906"
H = "/home/user"


def scene(size: tuple[int, int], sky: tuple[int, int, int], hill: tuple[int, int, int]) -> Image.Image:
    """A small landscape: sky gradient, a sun on the left, hills and a house on the right.
    Nothing in it is symmetric (a mirrored copy differs) and no area is grey (GIMP's saturation
    and the checks' hue channel stay well defined)."""
    w, h = size
    im = Image.new("RGB", size)
    d = ImageDraw.Draw(im)
    horizon = h * 3 // 5
    for y in range(horizon):
        t = y / horizon
        d.line([(0, y), (w, y)], fill=tuple(int(c * (1 - 0.45 * t) + 60 * t) for c in sky))
    d.rectangle((0, horizon, w, h), fill=hill)
    d.ellipse((w // 10, h // 10, w // 10 + h // 5, h // 10 + h // 5), fill=(250, 200, 40))
    d.polygon([(0, horizon + 10), (w // 3, horizon - h // 6), (w * 2 // 3, horizon + 20), (0, h)],
              fill=tuple(max(0, c - 50) for c in hill))
    x0, y0 = w * 13 // 20, horizon - h // 10
    d.rectangle((x0, y0, x0 + w // 6, y0 + h // 5), fill=(200, 90, 50))
    d.polygon([(x0 - 10, y0), (x0 + w // 12, y0 - h // 8), (x0 + w // 6 + 10, y0)], fill=(120, 30, 40))
    d.rectangle((x0 + w // 24, y0 + h // 12, x0 + w // 12, y0 + h // 5), fill=(90, 50, 20))
    return im


def save(im: Image.Image, out: Path) -> None:
    """Write a side file and rename it over ``out``: a desktop reading the suite's cache while
    the suite is rebuilt sees the old or the new image, never half of one."""
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    part = out.with_name(f".part-{out.name}")
    part.write_bytes(buf.getvalue())
    os.replace(part, out)


def open_image(tid: str, name: str, folder: str) -> list[dict]:
    """Setup: put the image in place, start GIMP on it and wait for its image window (titled
    "[<stem>] (imported)-1.0 (...) – GIMP")."""
    stem = name.rsplit(".", 1)[0]
    return [dl(tid, name, f"{folder}/{name}"), launch("gimp", f"{folder}/{name}"),
            wait_window(f"{stem}] (imported)", 600), activate(f"[{stem}] (imported)")]


def export_as(path: str, kind: str) -> list[list[str]]:
    """File > Export As: type the full path over the proposed name, then accept the format's
    options dialog (Enter = Export) and wait until the export is done."""
    return [hotkey("shift", "ctrl", "e") + await_window("Export Image$"),
            hotkey("ctrl", "a") + type_text(path) + press("enter") + await_window(f"Export Image as {kind}"),
            press("enter") + await_window("Export Image", present=False, n=200)]


def written(path: str) -> dict:
    """Evaluator postconfig: wait (bounded) until the exported file is there."""
    return execute(poll(f"[ -s {path} ]", 60) + "true")


def filter_dialog(menu: list[str], title: str, value: str) -> list[list[str]]:
    """Open a Colors filter, type the value into its first field (Tab from the presets), OK."""
    return [menu + await_window(title),
            press("tab") + hotkey("ctrl", "a") + type_text(value + "\t") + pause(0.5) + hotkey("alt", "o")
            + await_window(title, present=False, n=200)]


def build(kit) -> None:
    # -- flip horizontally -------------------------------------------------------------------
    save(scene((480, 320), (90, 150, 230), (60, 170, 70)), kit.path(MIRROR, "lakeside.png"))
    out = f"{H}/Desktop/lakeside_mirrored.png"
    kit.task("gimp", MIRROR,
             "Mirror the picture ~/Desktop/lakeside.png left to right in GIMP (flip it horizontally) and "
             "export the result as ~/Desktop/lakeside_mirrored.png.",
             open_image(MIRROR, "lakeside.png", f"{H}/Desktop"),
             {"postconfig": [written(out)], "func": "check_image_mirror",
              "result": vm_file(out), "expected": gold(MIRROR, "lakeside.png")},
             [hotkey("alt", "i") + pause() + press("t") + pause() + press("h")]  # Image > Transform > Flip Horizontally
             + export_as(out, "PNG") + [DONE], ["gimp"])

    # -- scale down, keeping the aspect ratio --------------------------------------------------
    save(scene((800, 600), (120, 170, 240), (90, 160, 50)), kit.path(SCALE, "poster.png"))
    out = f"{H}/Desktop/poster_small.png"
    kit.task("gimp", SCALE,
             "Use GIMP to scale ~/Desktop/poster.png down to 400 pixels wide, keeping its aspect ratio, "
             "and export it as ~/Desktop/poster_small.png.",
             open_image(SCALE, "poster.png", f"{H}/Desktop"),
             {"postconfig": [written(out)], "func": ["check_image_size", "check_structure_sim_resized"],
              "conj": "and", "result": [vm_file(out), vm_file(out)],
              "expected": [rule(width=400, height=300), gold(SCALE, "poster.png")]},
             [hotkey("alt", "i") + pause() + press("s") + await_window("Scale Image"),  # Image > Scale Image
              type_text("400\t") + pause(0.5) + hotkey("alt", "s") + await_window("Scale Image", present=False)]
             + export_as(out, "PNG") + [DONE], ["gimp"])

    # -- export to another format --------------------------------------------------------------
    save(scene((640, 400), (200, 120, 200), (40, 140, 120)), kit.path(JPEG, "dusk.png"))
    out = f"{H}/Pictures/dusk.jpg"
    kit.task("gimp", JPEG,
             "Open ~/Pictures/dusk.png in GIMP and export a JPEG copy of it as ~/Pictures/dusk.jpg.",
             open_image(JPEG, "dusk.png", f"{H}/Pictures"),
             {"postconfig": [written(out)], "func": ["check_file_exists_and_structure_sim", "exact_match"],
              "conj": "and",
              "result": [vm_file(out), cmdline(f"file -b --mime-type {out} | tr -d '\\n'")],
              "expected": [gold(JPEG, "dusk.png"), rule(expected="image/jpeg")]},
             export_as(out, "JPEG") + [DONE], ["gimp"])

    # -- a preference saved to gimprc ----------------------------------------------------------
    kit.task("gimp", UNDO,
             "In GIMP's preferences, set the minimal number of undo levels to 25 and confirm with OK.",
             [launch("gimp"), wait_window("GNU Image Manipulation Program", 600),
              activate("GNU Image Manipulation Program")],
             {"func": "check_config_status", "result": {"type": "gimp_config_file", "file_name": "gimprc",
                                                        "dest": "gimprc"},
              "expected": rule(key="undo-levels", value="25")},
             # Edit > Preferences is the fifth item from the bottom of the Edit menu; it opens on
             # System Resources, whose first field (after the page list) is the undo levels.
             [hotkey("alt", "e") + pause() + press("up", 5) + press("enter") + await_window("Preferences$"),
              press("tab") + hotkey("ctrl", "a") + type_text("25\t") + pause(0.5) + hotkey("alt", "o")
              + await_window("Preferences$", present=False)]
             + [DONE], ["gimp"])

    # -- darker -------------------------------------------------------------------------------
    save(scene((480, 360), (110, 180, 250), (120, 200, 80)), kit.path(DARKEN, "meadow.png"))
    out = f"{H}/Desktop/meadow_dark.png"
    kit.task("gimp", DARKEN,
             "The photo ~/Desktop/meadow.png is too bright. Darken it in GIMP (for example with "
             "Colors > Brightness-Contrast) and export the result as ~/Desktop/meadow_dark.png.",
             open_image(DARKEN, "meadow.png", f"{H}/Desktop"),
             {"postconfig": [written(out)], "func": "check_brightness_decrease_and_structure_sim",
              "result": vm_file(out), "expected": gold(DARKEN, "meadow.png")},
             # Colors > Brightness-Contrast is the 8th item of the Colors menu.
             filter_dialog(hotkey("alt", "c") + pause() + press("down", 7) + press("enter"),
                           "Brightness-Contrast", "-50")
             + export_as(out, "PNG") + [DONE], ["gimp"])

    # -- more saturated ------------------------------------------------------------------------
    save(scene((480, 360), (130, 160, 200), (110, 150, 90)), kit.path(SATURATE, "valley.png"))
    out = f"{H}/Desktop/valley_vivid.png"
    kit.task("gimp", SATURATE,
             "Make the colours of ~/Desktop/valley.png more saturated in GIMP and export the result as "
             "~/Desktop/valley_vivid.png.",
             open_image(SATURATE, "valley.png", f"{H}/Desktop"),
             {"postconfig": [written(out)], "func": "check_saturation_increase_and_structure_sim",
              "result": vm_file(out), "expected": gold(SATURATE, "valley.png")},
             # Colors > Saturation is the 5th item of the Colors menu; its Scale field multiplies.
             filter_dialog(hotkey("alt", "c") + pause() + press("down", 4) + press("enter"), "Saturation", "1.8")
             + export_as(out, "PNG") + [DONE], ["gimp"])

    kit.infeasible("gimp", INFEASIBLE,
                   "In GIMP, use the built-in Generative Fill AI tool to replace the sky of ~/Desktop/photo.png "
                   "with a starry night described by the prompt 'milky way over mountains'.")
