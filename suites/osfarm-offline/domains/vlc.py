"""vlc: playback through VLC's GUI (read back over its HTTP interface), full screen, and
preferences saved to vlcrc.

The media are ten minutes long, so a file the agent started is still playing when the evaluator
asks, yet only tens of kilobytes: a still picture at one frame per second, and a chime followed
by silence.  The Simple Preferences dialog always maps at the same place over a VLC window
started without a file, so its reference solutions click its tabs and fields.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw
from suitekit import (
    DONE,
    activate,
    at,
    await_window,
    dl,
    execute,
    hotkey,
    launch,
    pause,
    poll,
    press,
    rule,
    type_text,
    wait_window,
)

PLAY = "0f5d2a10-0000-4000-8000-000000000601"
FULLSCREEN = "0f5d2a10-0000-4000-8000-000000000602"
MINIMAL = "0f5d2a10-0000-4000-8000-000000000603"
ONE_INSTANCE = "0f5d2a10-0000-4000-8000-000000000604"
RECORDINGS = "0f5d2a10-0000-4000-8000-000000000605"
INFEASIBLE = "0f5d2a10-0000-4000-8000-000000000907"
H = "/home/user"
SECONDS = 600
# Byte-identical output on every build (no encoder version tags or timestamps).
BITEXACT = ["-threads", "1", "-map_metadata", "-1", "-fflags", "+bitexact", "-flags:v", "+bitexact",
            "-flags:a", "+bitexact"]

# Simple Preferences over a VLC started without a file (1920x1080 screen).
# (light desktop, GNOME)
PREFS_INPUT_TAB = f"pyautogui.click({at((996, 224), (1030, 250))})"
PREFS_MINIMAL_VIEW = f"pyautogui.click({at((737, 456), (772, 484))})"     # Interface: "Start in minimal view mode"
# Interface: "...one instance when started from file manager"
PREFS_ONE_INSTANCE_FM = f"pyautogui.click({at((600, 666), (634, 694))})"
# Input / Codecs: "Record directory or filename"
PREFS_RECORD_PATH = f"pyautogui.click({at((1037, 653), (1071, 681))})"


def ffmpeg(out: Path, *args: str) -> None:
    """Encode to a side file, then rename it over ``out``: a desktop reading the suite's cache
    while the suite is rebuilt sees the old or the new file, never half of one."""
    part = out.with_name(f".part-{out.name}")
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args, *BITEXACT, str(part)], check=True)
    os.replace(part, out)


def chime(path: Path) -> None:
    """Mono Vorbis: three seconds of a 660 Hz tone, then silence."""
    ffmpeg(path, "-f", "lavfi", "-i", f"sine=frequency=660:duration={SECONDS}:sample_rate=8000",
           "-af", "volume='if(lt(t,3),1,0)':eval=frame", "-ac", "1", "-c:a", "libvorbis", "-q:a", "-1")


def still_video(path: Path) -> None:
    """H.264 of a still test card at one frame per second (x264 codes the repeats as skips)."""
    im = Image.new("RGB", (320, 240), (30, 60, 110))
    d = ImageDraw.Draw(im)
    for i, colour in enumerate([(230, 60, 50), (240, 200, 40), (60, 180, 90), (70, 120, 230)]):
        d.rectangle((20 + 70 * i, 40, 80 + 70 * i, 150), fill=colour)
    d.ellipse((120, 160, 200, 230), fill=(250, 250, 250))
    with tempfile.TemporaryDirectory() as tmp:
        card = Path(tmp) / "card.png"
        im.save(card)
        ffmpeg(path, "-loop", "1", "-framerate", "1", "-i", str(card), "-t", str(SECONDS), "-c:v", "libx264",
               "-preset", "medium", "-tune", "stillimage", "-crf", "30", "-g", str(SECONDS), "-pix_fmt", "yuv420p")


def vlc_alone() -> list[dict]:
    return [launch("vlc"), wait_window("VLC media player", 300), activate("VLC media player")]


def vlcrc() -> dict:
    return {"type": "vlc_config", "dest": "vlcrc"}


def preferences(actions: list[str]) -> list[list[str]]:
    """Tools > Preferences (Ctrl+P), the given actions, then Save (the dialog's default button)."""
    return [hotkey("ctrl", "p") + await_window("Simple Preferences"),
            actions,
            press("enter") + await_window("Simple Preferences", present=False)]


def build(kit) -> None:
    # -- play a file through Media > Open File -----------------------------------------------
    chime(kit.path(PLAY, "morning_chime.ogg"))
    kit.task("vlc", PLAY, "Play the audio file ~/Music/morning_chime.ogg in the VLC media player that is open.",
             [dl(PLAY, "morning_chime.ogg", f"{H}/Music/morning_chime.ogg")] + vlc_alone(),
             {"func": "is_vlc_playing", "result": {"type": "vlc_playing_info", "dest": "status.xml"},
              "expected": rule(type="file_name", file_name="morning_chime.ogg")},
             [hotkey("ctrl", "o") + await_window("Select one or more files to open"),
              type_text(f"{H}/Music/morning_chime.ogg") + press("enter")
              + await_window("morning_chime.ogg - VLC media player"), DONE], ["vlc"])

    # -- full screen ---------------------------------------------------------------------------
    still_video(kit.path(FULLSCREEN, "test_card.mp4"))
    video = f"{H}/Videos/test_card.mp4"
    kit.task("vlc", FULLSCREEN, "Switch the video that VLC is playing to full-screen mode.",
             [dl(FULLSCREEN, "test_card.mp4", video), launch("vlc", video),
              wait_window("test_card.mp4 - VLC media player", 300), activate("test_card.mp4 - VLC media player")],
             {"postconfig": [execute(poll("wmctrl -lG | grep -q ' 1920 *1080 .*VLC media player'", 30) + "true")],
              "func": "is_vlc_fullscreen", "result": {"type": "vm_window_size", "app_class_name": "vlc"},
              "expected": {"type": "vm_screen_size"}},
             [press("f"), DONE], ["vlc"])

    # -- preferences saved to vlcrc ------------------------------------------------------------
    kit.task("vlc", MINIMAL, "Set VLC to start in minimal view mode from now on, and save the preference.",
             vlc_alone(),
             {"func": "check_qt_minimal_view", "result": vlcrc(), "expected": rule(expected_qt_minimal_view="1")},
             preferences([PREFS_MINIMAL_VIEW]) + [DONE], ["vlc"])

    kit.task("vlc", ONE_INSTANCE,
             "Files opened from the file manager should each get their own VLC window: turn off VLC's "
             "\"Use only one instance when started from file manager\" preference and save it.",
             vlc_alone(),
             {"func": "check_one_instance_when_started_from_file", "result": vlcrc(),
              "expected": rule(expected_one_instance_when_started_from_file="0")},
             preferences([PREFS_ONE_INSTANCE_FM]) + [DONE], ["vlc"])

    recordings = f"{H}/Videos/recordings"
    kit.task("vlc", RECORDINGS,
             f"Make VLC save its recordings into the folder {recordings} (set it in the preferences and save).",
             [execute(f"mkdir -p {recordings}")] + vlc_alone(),
             {"func": "is_vlc_recordings_folder", "result": vlcrc(),
              "expected": rule(recording_file_path=recordings)},
             # A line edit drops keys typed the moment it takes the focus: pause after the click.
             preferences([PREFS_INPUT_TAB] + pause(0.5) + [PREFS_RECORD_PATH] + pause(0.5) + type_text(recordings))
             + [DONE], ["vlc"])

    kit.infeasible("vlc", INFEASIBLE,
                   "In VLC, turn on the built-in feature that translates the spoken dialogue of the video "
                   "I am watching into Spanish speech in real time.")
