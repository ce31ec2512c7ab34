"""The desktop starts as OSWorld's VM does where OSWorld's task files look (issue 19 item 2):
default apps, the apps tasks launch, the agent's python3, the home's user dirs, the session bus
where Ubuntu has it. Real desktops of the shared farm; the two OSWorld tasks that read these
states give the noop agent nothing and can be solved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from osfarm.desktop.session.session import DEFAULT_APPS, TOTEM_VIDEO_TYPES
from osfarm.env import SyncTaskEnv
from osfarm.evaluators.getters.vlc import _VIDEO_SUBTYPES
from osfarm.farm.server import FarmServer
from osfarm.tasks.model import load_task

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "shared" / "osworld" / "examples"
VLC_TASK = EXAMPLES / "multi_apps" / "937087b6-f668-4ba6-9110-60682ee33441.json"  # make VLC the default
FAVORITES_TASK = EXAMPLES / "os" / "ec4e3f68-9ea4-4c18-a5c9-69f89d1178b3.json"  # remove vim from favorites
PROBE_TASK = {"id": "defaults-probe", "instruction": "look", "config": [],
              "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "true"},
                            "expected": {"type": "rule", "rules": {"expected": "x"}}}}

PROBE = r"""
import json, os, shutil, subprocess
def out(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
found = out("python3", "-c", "import importlib.util as u; "
            "print(' '.join(m for m in ('pyautogui', 'numpy', 'osfarm', 'fastapi', 'httpx') if u.find_spec(m)))")
print(json.dumps({
    "python3": out("python3", "-c", "import sys; print(sys.executable)"),
    "python": out("python", "-c", "import os, sys; print(os.path.realpath(sys.executable))"),
    "modules": found.split(),
    "defaults": {t: out("xdg-mime", "query", "default", t) for t in
                 ("video/mp4", "video/x-matroska", "video/webm", "application/pdf", "inode/directory", "text/plain")},
    "apps": {a: bool(shutil.which(a)) for a in ("nautilus", "totem", "evince", "vlc")},
    "dirs": sorted(d for d in os.listdir(os.path.expanduser("~")) if not d.startswith(".")),
    "bus": os.path.exists("/run/user/1000/bus"),
    "lock": out("gsettings", "get", "org.gnome.desktop.screensaver", "lock-enabled"),
}))
"""


def _skip_without(path: Path) -> None:
    if not path.is_file():
        pytest.skip(f"OSWorld's task file {path} is not here")


def test_default_apps_cover_every_type_the_video_getter_counts() -> None:
    assert set(_VIDEO_SUBTYPES) <= set(TOTEM_VIDEO_TYPES)
    players = [DEFAULT_APPS[f"video/{t}"] for t in _VIDEO_SUBTYPES]
    assert players.count("vlc.desktop") == 1 and DEFAULT_APPS["video/mp4"] == "vlc.desktop"


def test_fresh_desktop_state_is_osworlds(farm: FarmServer, tmp_path: Path) -> None:
    with SyncTaskEnv(farm.url, farm.token, work_dir=tmp_path) as env:
        env.reset(PROBE_TASK)
        info = env.step(PROBE)[4]
    text = info["results"][0]["output"]
    got = json.loads(text.strip().splitlines()[-1])
    # the agent's Python is the system's, with pyautogui, Debian's numpy (OSWorld's task scripts
    # import it, e.g. multi_apps/e8172110) and none of osfarm's packages
    assert got["python3"] == "/usr/bin/python3" and got["python"].startswith("/usr/bin/python3"), got
    assert got["modules"] == ["pyautogui", "numpy"], got
    assert got["defaults"] == {
        "video/mp4": "vlc.desktop", "video/x-matroska": "org.gnome.Totem.desktop",
        "video/webm": "org.gnome.Totem.desktop", "application/pdf": "org.gnome.Evince.desktop",
        "inode/directory": "org.gnome.Nautilus.desktop", "text/plain": "org.xfce.mousepad.desktop"}, got
    assert all(got["apps"].values()), got
    assert got["dirs"] == sorted(["Desktop", "Documents", "Downloads", "Music", "Pictures", "Public", "Templates",
                                  "Videos"]), got
    assert got["bus"] and got["lock"] == "true", got


def test_make_vlc_the_default_player_is_not_done_already(farm: FarmServer, tmp_path: Path) -> None:
    _skip_without(VLC_TASK)
    task = load_task(VLC_TASK)
    with SyncTaskEnv(farm.url, farm.token, work_dir=tmp_path / "noop") as env:
        env.reset(task)
        _obs, reward, terminated, _t, _i = env.step("DONE")
        assert terminated and reward == 0.0
    types = " ".join(f"video/{t}" for t in TOTEM_VIDEO_TYPES)
    with SyncTaskEnv(farm.url, farm.token, work_dir=tmp_path / "solve") as env:
        env.reset(task)
        env.step(f"import subprocess; subprocess.run('xdg-mime default vlc.desktop {types}', shell=True, check=True)")
        _obs, reward, terminated, _t, _i = env.step("DONE")
        assert terminated and reward == 1.0


def test_gnome_favorites_task_can_be_solved(farm: FarmServer, tmp_path: Path) -> None:
    """Its setup writes org.gnome.shell favorite-apps through /run/user/1000/bus: the schema and
    that bus must exist for the agent to have anything to change."""
    _skip_without(FAVORITES_TASK)
    task = load_task(FAVORITES_TASK)
    with SyncTaskEnv(farm.url, farm.token, work_dir=tmp_path / "noop") as env:
        env.reset(task)
        _obs, reward, terminated, _t, _i = env.step("DONE")
        assert terminated and reward == 0.0
    with SyncTaskEnv(farm.url, farm.token, work_dir=tmp_path / "solve") as env:
        env.reset(task)
        env.step("import subprocess; subprocess.run(['gsettings', 'set', 'org.gnome.shell', 'favorite-apps', "
                 "\"['thunderbird.desktop', 'google-chrome.desktop']\"], check=True)")
        _obs, reward, terminated, _t, _i = env.step("DONE")
        assert terminated and reward == 1.0
