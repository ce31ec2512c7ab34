"""OSWorld getters against one real sandbox desktop: files go in with upload_file and come back
out through the getters, commands run in the box, and a real Chromium answers DevTools."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import pytest

from osfarm.evaluators.getters import GETTERS, EvalEnv
from osfarm.tasks.controller import GuestController
from osfarm.testing.boxes import sandbox_guest
from osfarm.testing.waiting import wait_until

CHROME = "/home/user/.config/google-chrome"


@pytest.fixture(scope="module")
async def controller() -> AsyncIterator[GuestController]:
    async with sandbox_guest("g1", 1024, 768) as ctl:
        yield ctl


@pytest.fixture
def env(controller: GuestController, tmp_path: Path) -> EvalEnv:
    return EvalEnv(controller=controller, cache_dir=tmp_path / "cache", task_id="t1", screen=(1024, 768))


def get(name: str, env: EvalEnv, config: dict):
    return GETTERS[name](env, config)


class FakeCache:
    def __init__(self, files: dict[str, Path]):
        self.files = files

    def lookup(self, url: str, name: str | None = None) -> Path | None:
        return self.files.get(url)


def test_registry_names() -> None:
    for name in ("vm_file", "cloud_file", "rule", "vm_command_line", "rule_relativeTime", "bookmarks",
                 "open_tabs_info", "vlc_config"):
        assert name in GETTERS
    assert "googledrive_file" not in GETTERS


def test_vm_file_single_multi_missing(env: EvalEnv) -> None:
    env.controller.upload_file("/home/user/a.txt", b"alpha")
    env.controller.upload_file("/home/user/b.txt", b"beta")
    p = get("vm_file", env, {"path": "/home/user/a.txt", "dest": "a.txt"})
    assert Path(p).read_bytes() == b"alpha" and Path(p).parent == env.cache_dir
    assert get("vm_file", env, {"path": "/home/user/nope.txt", "dest": "nope.txt"}) is None
    both = get("vm_file", env, {"multi": True, "path": ["/home/user/a.txt", "/home/user/nope", "/home/user/b.txt"],
                                "dest": ["a2", "n2", "b2"], "gives": [0, 1, 2]})
    assert [Path(both[0]).read_bytes(), both[1], Path(both[2]).read_bytes()] == [b"alpha", None, b"beta"]
    only = get("vm_file", env, {"multi": True, "path": ["/home/user/a.txt", "/home/user/b.txt"],
                                "dest": ["a3", "b3"], "gives": [1]})
    assert Path(only).read_bytes() == b"beta"


def test_vm_file_time_suffix(env: EvalEnv) -> None:
    env.clock = lambda: datetime(2024, 3, 7)
    env.controller.upload_file("/home/user/rep2024_03_07.csv", b"x,y")
    p = get("vm_file", env, {"path": "/home/user/rep.csv", "dest": "rep.csv", "time_suffix": True})
    assert p.endswith("rep2024_03_07.csv") and Path(p).read_bytes() == b"x,y"


def test_cloud_and_cache_file(env: EvalEnv, tmp_path: Path) -> None:
    src = tmp_path / "gold.xlsx"
    src.write_bytes(b"gold")
    env.offline_cache = FakeCache({"https://h/gold.xlsx": src})
    p = get("cloud_file", env, {"path": "https://h/gold.xlsx", "dest": "gold.xlsx"})
    assert Path(p).read_bytes() == b"gold"
    assert get("cloud_file", env, {"path": "https://h/missing", "dest": "m.xlsx"}) is None
    many = get("cloud_file", env, {"multi": True, "path": ["https://h/gold.xlsx", "https://h/missing"],
                                   "dest": ["g1", "m1"], "gives": [0, 1]})
    assert Path(many[0]).read_bytes() == b"gold" and many[1] is None
    assert get("cache_file", env, {"path": "gold.xlsx"}) == p
    assert get("cache_file", env, {"path": "absent"}) is None


def test_content_from_vm_file(env: EvalEnv, tmp_path: Path) -> None:
    import pandas as pd

    x = tmp_path / "t.xlsx"
    pd.DataFrame({"a": [1, 2], "b": ["u", "v"]}).to_excel(x, index=False)
    env.controller.upload_file("/home/user/t.xlsx", x.read_bytes())
    cfg = {"path": "/home/user/t.xlsx", "file_type": "xlsx", "file_content": "last_row"}
    assert get("content_from_vm_file", env, cfg) == ["2", "v"]
    assert get("content_from_vm_file", env, {**cfg, "path": "/home/user/none.xlsx"}) is None


def test_commands_and_info(env: EvalEnv) -> None:
    assert get("vm_command_line", env, {"command": ["echo", "hello"]}).strip() == "hello"
    assert get("vm_command_line", env, {"command": "echo $((6*7))", "shell": True}).strip() == "42"
    assert "oops" in get("vm_command_error", env, {"command": "echo oops >&2", "shell": True})
    assert get("vm_screen_size", env, {}) == {"width": 1024, "height": 768}
    env.controller.execute(["mkdir", "-p", "/home/user/d/sub"])
    env.controller.upload_file("/home/user/d/f.jpg", b"j")
    tree = get("list_directory", env, {"path": "/home/user/d"})
    assert sorted(c["name"] for c in tree["children"]) == ["f.jpg", "sub"]
    assert get("list_directory", env, {"path": "/home/user/nothere"}) is None
    assert get("accessibility_tree", env, {}).lstrip().startswith("<")


def test_rule_and_relative_time(env: EvalEnv) -> None:
    assert get("rule", env, {"rules": {"expected": ["a"]}}) == {"expected": ["a"]}
    env.clock = lambda: datetime(2024, 12, 18)  # a Wednesday
    cfg = {"rules": {"relativeTime": {"from": "5th next month"},
                     "expected": {"time": "{DoW}, {Month} {Day0D}, {Year}", "x": 1}}}
    assert get("rule_relativeTime", env, cfg)["expected"] == {"time": "Sun, Jan 05, 2025", "x": 1}
    assert cfg["rules"]["expected"]["time"].startswith("{DoW}")  # the task is not modified
    cfg = {"rules": {"relativeTime": {"from": "tomorrow"},
                     "expected": {"time": "{Year}-{Month0D}-{Day0D} {MonthFull}"}}}
    assert get("rule_relativeTime", env, cfg)["expected"]["time"] == "2024-12-19 December"
    cfg = {"rules": {"relativeTime": {"from": "next Monday", "to": "next Friday"},
                     "expected": {"from": "{month} {DayD}", "to": "{MonthD}/{DayD}"}}}
    assert get("rule_relativeTime", env, cfg)["expected"] == {"from": "december 23", "to": "12/27"}
    cfg = {"rules": {"relativeTime": {"from": "this Saturday", "to": "this Sunday"},
                     "expected": {"from": "{DayD}", "to": "{DayD}"}}}
    assert get("rule_relativeTime", env, cfg)["expected"] == {"from": "21", "to": "22"}
    cfg = {"rules": {"relativeTime": {"from": "first monday four months later"},
                     "expected": {"time": "{Year}-{Month0D}-{Day0D}"}}}
    assert get("rule_relativeTime", env, cfg)["expected"]["time"] == "2025-04-07"


def _history_db(path: Path) -> bytes:
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE urls (id INTEGER PRIMARY KEY, url TEXT, title TEXT, visit_count INT, "
                  "last_visit_time INT)")
        c.execute("INSERT INTO urls (url, title, visit_count, last_visit_time) VALUES ('https://a.org/', 'A', 1, 1300)")
        c.execute("CREATE TABLE cookies (host_key TEXT, name TEXT, value TEXT)")
        c.execute("INSERT INTO cookies VALUES ('.amazon.com', 'session-id', '1')")
    return path.read_bytes()


def test_chrome_profile_files(env: EvalEnv, tmp_path: Path) -> None:
    ctl = env.controller
    # Nothing there yet: OSWorld's defaults.
    assert get("bookmarks", env, {}) == []
    assert get("default_search_engine", env, {}) == "Google"
    assert get("history", env, {"dest": "h"}) is None
    assert get("enable_do_not_track", env, {}) == "false"
    prefs = {"default_search_provider_data": {"template_url_data": {"short_name": "Bing"}},
             "enable_do_not_track": True, "safebrowsing": {"enabled": True},
             "session": {"restore_on_startup": 5}, "profile": {"name": "Thomas"},
             "webkit": {"webprefs": {"default_font_size": 24}},
             "extensions": {"settings": {"abc": {"path": "/home/user/ext", "manifest": {"name": "Helper"}}}}}
    ctl.upload_file(f"{CHROME}/Default/Preferences", json.dumps(prefs).encode())
    bm = {"roots": {"bookmark_bar": {"children": [{"type": "url", "name": "Ex", "url": "https://ex.org/"}]}}}
    ctl.upload_file(f"{CHROME}/Default/Bookmarks", json.dumps(bm).encode())
    db = _history_db(tmp_path / "h.sqlite")
    ctl.upload_file(f"{CHROME}/Default/History", db)
    ctl.upload_file(f"{CHROME}/Default/Cookies", db)
    assert get("bookmarks", env, {}) == bm["roots"]
    assert get("default_search_engine", env, {}) == "Bing"
    assert get("history", env, {"dest": "History"}) == [("https://a.org/", "A", 1300)]
    assert get("cookie_data", env, {"dest": "Cookies"}) == [(".amazon.com", "session-id", "1")]
    assert get("enable_do_not_track", env, {}) == "true"
    assert get("enable_safe_browsing", env, {}) == "true"
    assert get("new_startup_page", env, {}) == "true"
    assert get("profile_name", env, {}) == "Thomas"
    assert get("chrome_font_size", env, {}) == {"default_font_size": 24}
    assert get("find_unpacked_extension_path", env, {}) == ["/home/user/ext"]
    assert get("find_installed_extension_name", env, {}) == ["Helper"]
    prefs["session"]["restore_on_startup"] = 1
    prefs["default_search_provider"] = {"guid": "485bf7d3-0215-45af-87dc-538868000092"}
    ctl.upload_file(f"{CHROME}/Default/Preferences", json.dumps(prefs).encode())
    assert get("new_startup_page", env, {}) == "false"
    assert get("default_search_engine", env, {}) == "DuckDuckGo"
    # Chromium's own profile folder is read when Chrome's has no such file.
    ctl.upload_file("/home/user/.config/chromium/Local State", json.dumps({"intl": {"app_locale": "de"}}).encode())
    assert get("chrome_language", env, {}) == "de"
    ctl.upload_file("/home/user/Desktop/app.desktop", b"[Desktop Entry]\nName=App\n")
    ctl.upload_file("/home/user/Desktop/notes.txt", b"n")
    assert get("shortcuts_on_desktop", env, {}) == {"app.desktop": "[Desktop Entry]\nName=App\n"}


def test_vlc_and_gimp(env: EvalEnv) -> None:
    env.controller.upload_file("/home/user/.config/vlc/vlcrc", b"[qt]\nqt-bgcone=0\n")
    p = get("vlc_config", env, {"dest": "vlcrc"})
    assert Path(p).read_bytes() == b"[qt]\nqt-bgcone=0\n"
    assert get("vlc_playing_info", env, {"dest": "status.xml"}) is None  # no VLC listening
    assert get("gimp_config_file", env, {"file_name": "no-such-rc", "dest": "x"}) is None
    env.controller.upload_file("/home/user/.config/GIMP/2.10/gimprc", b"(theme \"Dark\")\n")
    gimprc = get("gimp_config_file", env, {"file_name": "gimprc", "dest": "gimprc"})
    assert Path(gimprc).read_bytes() == b"(theme \"Dark\")\n"


@pytest.mark.slow
def test_chromium_devtools_tabs(env: EvalEnv) -> None:
    ctl = env.controller
    assert get("open_tabs_info", env, {}) == []  # no browser yet
    assert get("active_tab_info", env, {}) is None
    ctl.upload_file("/home/user/a.html", b"<!doctype html><html><head><title>Tab A</title></head>"
                                          b"<body><p id=m>marker-41</p></body></html>")
    ctl.launch(["chromium", "--no-sandbox", "--remote-debugging-port=9222", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-gpu", f"--user-data-dir={CHROME}", "file:///home/user/a.html"])
    tabs = wait_until(lambda: [t for t in get("open_tabs_info", env, {}) if t["title"] == "Tab A"], 60,
                      "chromium's DevTools to list Tab A", interval=0.5)
    assert tabs == [{"title": "Tab A", "url": "file:///home/user/a.html"}]
    info = get("active_tab_info", env, {})
    assert info["title"] == "Tab A" and info["url"] == "file:///home/user/a.html"
    assert "marker-41" in info["content"] and info["content"].startswith("<!DOCTYPE html>")
