"""The guest controller, the file cache and every setup type, against one real sandbox desktop."""

from __future__ import annotations

import http.server
import io
import json
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import openpyxl
import pytest
from PIL import Image

from osfarm.config import FarmSettings
from osfarm.http.download import DownloadPolicy
from osfarm.providers.base import DesktopSpec
from osfarm.providers.sandbox import SandboxProvider
from osfarm.tasks.controller import GuestController, GuestError
from osfarm.tasks.filecache import AssetMissing, FileCache, cache_name, load_url_map
from osfarm.tasks.model import ConfigStep
from osfarm.tasks.setup import SETUP_TYPES, SetupExecutor, SetupFailed, SetupUnsupported

SCREEN = (1024, 768)
CHROME_FLAGS = ["--remote-debugging-port=9222", "--no-sandbox", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-gpu",
                "--user-data-dir=/home/user/.config/google-chrome"]

LIST_TABS = """
import json, urllib.request
print(json.dumps([t["url"] for t in json.load(urllib.request.urlopen("http://localhost:9222/json/list"))
                  if t["type"] == "page"]))
"""


@pytest.fixture(scope="module")
async def guest() -> AsyncIterator[GuestController]:
    state = Path(tempfile.mkdtemp(prefix="ofs", dir="/tmp"))
    provider = SandboxProvider(FarmSettings(state_dir=state))
    handle = await provider.start("setup", DesktopSpec(width=SCREEN[0], height=SCREEN[1]))
    c = GuestController.from_endpoint(handle.endpoint)
    try:
        yield c
    finally:
        c.close()
        await provider.stop(handle)
        await provider.close()
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def cache(tmp_path: Path) -> FileCache:
    return FileCache(tmp_path / "cache", suite_dir=tmp_path / "suite", offline=True)


def executor(guest: GuestController, cache: FileCache, task_id: str = "t1", **kw: object) -> SetupExecutor:
    return SetupExecutor(guest, cache, task_id, SCREEN, **kw)  # type: ignore[arg-type]


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[str, Path, http.server.ThreadingHTTPServer]]:
    root = tmp_path / "www"
    root.mkdir()
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", root, srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


# ------------------------------------------------------------------ file cache (no desktop)


def test_cache_osworld_layout_and_url_map(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / "t1").mkdir(parents=True)
    url = "https://huggingface.co/datasets/x/resolve/main/a.xlsx"
    (root / "t1" / cache_name(url, "a.xlsx")).write_bytes(b"osworld")
    (root / "t1" / "plain.txt").write_bytes(b"plain")
    maps = tmp_path / "maps"
    (maps / "files").mkdir(parents=True)
    (maps / "files" / "b.bin").write_bytes(b"mapped")
    (maps / "urls.yaml").write_text("https://example.invalid/b.bin: files/b.bin\n")
    # the map's files lie outside the cache: the operator names their folder as a root
    fc = FileCache(root, load_url_map(maps / "urls.yaml"), offline=True, roots=[maps])
    assert fc.fetch(url, "t1", name="a.xlsx").read_bytes() == b"osworld"
    assert fc.fetch("https://example.invalid/x/plain.txt", "t1").read_bytes() == b"plain"
    assert fc.fetch("https://example.invalid/b.bin", "t1").read_bytes() == b"mapped"
    (maps / "urls.json").write_text(json.dumps({"https://example.invalid/c": "files/b.bin"}))
    fc2 = FileCache.with_map_file(root, maps / "urls.json", offline=True)
    assert fc2.fetch("https://example.invalid/c", "t2", name="c.bin").read_bytes() == b"mapped"


def test_cache_file_urls_and_suite_paths(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    (suite / "assets").mkdir(parents=True)
    (suite / "assets" / "d.txt").write_text("suite")
    fc = FileCache(tmp_path / "cache", suite_dir=suite, offline=True)
    assert fc.fetch("assets/d.txt", "t").read_text() == "suite"
    assert fc.fetch((suite / "assets" / "d.txt").as_uri(), "t").read_text() == "suite"
    with pytest.raises(AssetMissing, match="assets/nope.txt"):
        fc.fetch("assets/nope.txt", "t")


def test_cache_offline_missing_names_url_and_places(tmp_path: Path) -> None:
    fc = FileCache(tmp_path / "cache", offline=True)
    url = "https://example.invalid/data/missing.docx"
    with pytest.raises(AssetMissing) as ei:
        fc.fetch(url, "t9", name="missing.docx")
    msg = str(ei.value)
    assert url in msg and "not available offline" in msg
    assert str(tmp_path / "cache" / "t9" / "missing.docx") in msg and "url map" in msg


def test_cache_http_download_is_cached(tmp_path: Path, http_root) -> None:
    base, www, _srv = http_root
    (www / "e.txt").write_bytes(b"x" * 5000)
    # a task may not make the harness fetch from a loopback address unless it is allowed by name
    with pytest.raises(AssetMissing, match="non-public address 127.0.0.1"):
        FileCache(tmp_path / "cache", policy=DownloadPolicy()).fetch(f"{base}/e.txt", "t3")
    fc = FileCache(tmp_path / "cache", policy=DownloadPolicy(allowed_hosts=("127.0.0.1",)))
    p = fc.fetch(f"{base}/e.txt", "t3")
    assert p.read_bytes() == b"x" * 5000 and p.parent == tmp_path / "cache" / "t3"
    (www / "e.txt").unlink()  # served from the cache now, even offline
    assert fc.fetch(f"{base}/e.txt", "t3", offline=True).read_bytes() == b"x" * 5000
    with pytest.raises(AssetMissing, match="HTTP 404"):
        fc.fetch(f"{base}/gone.txt", "t3")
    assert not [q for q in (tmp_path / "cache" / "t3").iterdir() if q.name.startswith(".part")]


# ------------------------------------------------------------------ controller


def test_controller_routes(guest: GuestController) -> None:
    r = guest.execute(["echo", "hi there"])
    assert r["status"] == "success" and r["output"] == "hi there\n" and r["returncode"] == 0
    r = guest.execute("echo err >&2; exit 3", shell=True)
    assert r["returncode"] == 3 and r["error"] == "err\n"
    r = guest.execute("sleep 5", shell=True, timeout=0.5)
    assert r["status"] == "error" and r["returncode"] == -1
    guest.upload_file("/home/user/osf/dir/a.txt", b"abc\x00def")
    assert guest.get_file("/home/user/osf/dir/a.txt") == b"abc\x00def"
    assert guest.get_file("~/osf/dir/a.txt") == b"abc\x00def"
    assert guest.get_file("/home/user/osf/nope.txt") is None
    assert guest.wait_for_file("/home/user/osf/dir/a.txt", timeout=2, min_size=7)
    assert not guest.wait_for_file("/home/user/osf/nope.txt", timeout=0.3)
    tree = guest.get_directory_tree("/home/user/osf")
    assert tree and tree["children"][0]["name"] == "dir" and tree["children"][0]["children"][0]["name"] == "a.txt"
    assert guest.get_directory_tree("/home/user/osf/dir/a.txt") is None
    assert guest.get_screen_size() == SCREEN
    assert guest.screenshot()[:8] == b"\x89PNG\r\n\x1a\n"
    r = guest.run_python("print(6 * 7)")
    assert r["status"] == "success" and r["output"] == "42\n"
    r = guest.run_bash_script("pwd; echo $((1+2))", working_dir="/home/user/osf")
    assert r["returncode"] == 0 and r["output"] == "/home/user/osf\n3\n"
    assert guest.get_window_size("no-such-class-xyz") is None
    assert not guest.activate_window("no such window xyz")
    assert not guest.wait_for_window(title="no such window xyz", timeout=0.3)
    with pytest.raises(GuestError, match="/setup/launch.*no-such-program"):
        guest.launch(["no-such-program-xyz"])
    with pytest.raises(GuestError, match="/setup/change_wallpaper"):
        guest.change_wallpaper("/home/user/osf/nope.png")


# ------------------------------------------------------------------ setup types


def test_download_from_cache_layout_and_url_map(guest: GuestController, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    u1, u2 = "https://example.invalid/one.xlsx", "https://example.invalid/two.bin"
    (root / "dl").mkdir(parents=True)
    (root / "dl" / cache_name(u1, "one.xlsx")).write_bytes(b"one-bytes")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "two.bin").write_bytes(b"two-bytes")
    (tmp_path / "m" / "map.json").write_text(json.dumps({u2: "two.bin"}))
    fc = FileCache.with_map_file(root, tmp_path / "m" / "map.json", offline=True)
    reports = executor(guest, fc, "dl").run([
        {"type": "download", "parameters": {"files": [{"url": u1, "path": "/home/user/Desktop/one.xlsx"},
                                                      {"url": u2, "path": "/home/user/two.bin"}]}},
    ])
    assert reports[0].ok and reports[0].type == "download"
    assert guest.get_file("/home/user/Desktop/one.xlsx") == b"one-bytes"
    assert guest.get_file("/home/user/two.bin") == b"two-bytes"


def test_download_offline_missing_fails_naming_url(guest: GuestController, cache: FileCache) -> None:
    url = "https://example.invalid/absent.pptx"
    steps = [{"type": "sleep", "parameters": {"seconds": 0.01}},
             {"type": "download", "parameters": {"files": [{"url": url, "path": "/home/user/absent.pptx"}]}}]
    with pytest.raises(SetupFailed) as ei:
        executor(guest, cache).run(steps)
    assert ei.value.index == 1 and ei.value.type == "download" and url in str(ei.value)
    assert "looked in" in str(ei.value)


def test_execute_placeholders_stdout_and_until(guest: GuestController, cache: FileCache) -> None:
    ex = executor(guest, cache, "ex", client_password="s3cret", until_interval=0.05)
    reports = ex.run([
        ConfigStep(type="execute", parameters={
            "command": ["python3", "-c", "import sys; print(' '.join(sys.argv[1:]))", "{SCREEN_WIDTH}x{SCREEN_HEIGHT}",
                        "{SCREEN_WIDTH_HALF}", "{SCREEN_HEIGHT_HALF}", "pw={CLIENT_PASSWORD}"],
            "stdout": "out.txt"}),
        ConfigStep(type="command", parameters={"command": "echo {SCREEN_WIDTH} >&2", "shell": True,
                                               "stderr": "err.txt"}),
        ConfigStep(type="execute", parameters={
            "command": "n=$(cat ~/count 2>/dev/null || echo 0); n=$((n+1)); echo $n > ~/count; echo n=$n",
            "shell": True, "until": {"stdout": "n=3"}}),
    ])
    assert [r.ok for r in reports] == [True, True, True]
    assert (cache.root / "ex" / "out.txt").read_text() == "1024x768 512 384 pw=s3cret\n"
    assert (cache.root / "ex" / "err.txt").read_text() == "1024\n"
    assert "after 3 tries" in reports[2].detail and guest.get_file("/home/user/count") == b"3\n"
    # An episode saves stdout files where its cache_file getters read them (OSWorld's env.cache_dir).
    getters_dir = cache.root.parent / "episode-1"
    executor(guest, cache, "ex2", output_dir=getters_dir).run(
        [{"type": "execute", "parameters": {"command": ["echo", "listed"], "stdout": "ls.txt"}}])
    assert (getters_dir / "ls.txt").read_text() == "listed\n" and not (cache.root / "ex2" / "ls.txt").exists()
    with pytest.raises(SetupFailed, match="not met after 3 tries"):
        executor(guest, cache, until_tries=3, until_interval=0.01).run(
            [{"type": "execute", "parameters": {"command": ["false"], "until": {"returncode": 0}}}])
    with pytest.raises(SetupFailed, match="no-such-program-xyz"):
        executor(guest, cache).run([{"type": "execute", "parameters": {"command": ["no-such-program-xyz"]}}])


def test_upload_wallpaper_verification_history_and_errors(guest: GuestController, cache: FileCache,
                                                          tmp_path: Path) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, "PNG")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "wall.png").write_bytes(buf.getvalue())
    ex = executor(guest, cache)
    reports = ex.run([
        {"type": "upload_file", "parameters": {"files": [{"local_path": "wall.png", "path": "/home/user/wall.png"}]}},
        {"type": "change_wallpaper", "parameters": {"path": "/home/user/wall.png"}},
        {"type": "execute_with_verification", "parameters": {
            "command": "touch ~/verified", "shell": True,
            "verification": {"command_success": "test -f ~/verified"}, "max_wait_time": 3}},
        {"type": "update_browse_history", "parameters": {"profile_dir": "/home/user/osf-profile", "history": [
            {"url": "https://a.example/", "title": "A", "visit_time_from_now_in_seconds": 3600},
            {"url": "https://b.example/", "title": "B", "visit_time_from_now_in_seconds": 60}]}},
    ])
    assert all(r.ok for r in reports)
    assert guest.get_wallpaper() == buf.getvalue()
    r = guest.run_python(
        "import sqlite3, time\n"
        "db = sqlite3.connect('/home/user/osf-profile/Default/History')\n"
        "rows = db.execute('SELECT u.url, u.title, v.visit_time FROM urls u JOIN visits v ON v.url = u.id "
        "ORDER BY v.visit_time').fetchall()\n"
        "now = int(time.time() * 1e6) + 11644473600 * 10**6\n"
        "print([(u, t, round((now - vt) / 1e6 / 60)) for u, t, vt in rows])\n")
    assert r["output"].strip() == "[('https://a.example/', 'A', 60), ('https://b.example/', 'B', 1)]", r
    with pytest.raises(SetupFailed, match="not passed"):
        ex.run([{"type": "execute_with_verification", "parameters": {
            "command": "true", "shell": True, "verification": {"window_exists": "no such window xyz"},
            "max_wait_time": 0.5, "check_interval": 0.2}}])
    with pytest.raises(SetupFailed, match="unknown setup type"):
        ex.run([{"type": "teleport", "parameters": {}}])
    with pytest.raises(SetupFailed, match="bad parameters"):
        ex.run([{"type": "open", "parameters": {}}])
    for typ in ("googledrive", "login"):
        with pytest.raises(SetupUnsupported, match="needs a Google account") as ei:
            ex.run([{"type": "sleep", "parameters": {"seconds": 0}}, {"type": typ, "parameters": {}}])
        assert ei.value.index == 1 and ei.value.type == typ
    assert "googledrive" not in SETUP_TYPES and {"download", "open", "chrome_open_tabs"} <= SETUP_TYPES


def test_launch_activate_close_window(guest: GuestController, cache: FileCache) -> None:
    title = "osfarm term test"
    ex = executor(guest, cache)
    reports = ex.run([
        {"type": "launch", "parameters": {"command": ["xfce4-terminal", "--disable-server", "--title", title,
                                                      "--dynamic-title-mode=none"]}},
        {"type": "activate_window", "parameters": {"window_name": title}},
    ])
    assert reports[1].detail == f"activated {title!r}"
    assert guest.wait_for_window(wm_class="xfce4-terminal", timeout=5)
    assert guest.activate_window("xfce4-terminal", by_class=True)
    reports = ex.run([{"type": "close_window", "parameters": {"window_name": title, "strict": True}}])
    assert reports[0].detail == f"closed {title!r}"
    deadline = time.monotonic() + 10
    while guest.activate_window(title) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not guest.activate_window(title), "the terminal window is still there"


def test_open_xlsx_with_libreoffice(guest: GuestController, cache: FileCache, tmp_path: Path) -> None:
    wb = openpyxl.Workbook()
    wb.active.append(["name", "score"])
    wb.active.append(["Alice", 91])
    wb.save(tmp_path / "s.xlsx")
    guest.upload_file("/home/user/osf_scores.xlsx", (tmp_path / "s.xlsx").read_bytes())
    ex = executor(guest, cache, open_timeout=90)
    reports = ex.run([{"type": "open", "parameters": {"path": "/home/user/osf_scores.xlsx"}}])
    assert reports[0].ok
    assert guest.wait_for_window(title="osf_scores", wm_class="libreoffice", timeout=1), "not opened by Calc"
    guest.execute("pkill -f soffice", shell=True)


def test_csv_files_go_to_libreoffice_calc(guest: GuestController, cache: FileCache) -> None:
    # As on OSWorld's Ubuntu, a .csv opens in Calc (whose Text Import dialog comes first, so an
    # `open` step, which waits for a window named after the file, is not the way to check it).
    guest.upload_file("/home/user/osf_table.csv", b"name,score\nAlice,91\n")
    r = guest.execute("xdg-mime query filetype ~/osf_table.csv; xdg-mime query default text/csv", shell=True)
    assert r["output"].split() == ["text/csv", "libreoffice-calc.desktop"], r
    try:
        guest.launch(["xdg-open", "/home/user/osf_table.csv"])
        assert guest.wait_for_window(title="Text Import", timeout=90), "Calc did not start importing the csv"
    finally:
        guest.execute("pkill -f soffice", shell=True)


def test_chrome_open_and_close_tabs(guest: GuestController, cache: FileCache) -> None:
    pages = {}
    for n in ("a", "b", "c"):
        path = f"/home/user/osf_{n}.html"
        guest.upload_file(path, f"<html><head><title>page {n}</title></head><body>{n}</body></html>".encode())
        pages[n] = f"file://{path}"
    with pytest.raises(SetupFailed, match="DevTools not reachable"):
        executor(guest, cache, cdp_wait=0.3).run(
            [{"type": "chrome_open_tabs", "parameters": {"urls_to_open": [pages["b"]]}}])
    ex = executor(guest, cache)
    ex.run([
        {"type": "launch", "parameters": {"command": ["chromium", *CHROME_FLAGS, pages["a"]]}},
        {"type": "chrome_open_tabs", "parameters": {"urls_to_open": [pages["b"], pages["c"]]}},
    ])
    tabs = json.loads(guest.execute(["python3", "-c", LIST_TABS])["output"])
    assert {pages["a"], pages["b"], pages["c"]} <= set(tabs), tabs
    reports = ex.run([{"type": "chrome_close_tabs", "parameters": {"urls_to_close": [pages["b"]]}}])
    assert reports[0].detail == "closed 1 tab(s)"
    deadline = time.monotonic() + 5
    while pages["b"] in tabs and time.monotonic() < deadline:
        time.sleep(0.1)
        tabs = json.loads(guest.execute(["python3", "-c", LIST_TABS])["output"])
    assert pages["b"] not in tabs and pages["c"] in tabs and pages["a"] in tabs, tabs
    guest.execute("pkill -f chromium", shell=True)


# ------------------------------------------------------------------ commands that need the network

APT_UPDATE_INSTALL = ("echo {CLIENT_PASSWORD} | sudo -S apt-get update -y && "
                      "echo {CLIENT_PASSWORD} | sudo -S apt-get install {PKG} -y && echo after > /home/user/osf_after")


def _dpkg_status(guest: GuestController, package: str) -> str:
    r = guest.execute(["dpkg-query", "-W", "-f", "${Status}", package])
    return r["output"] if r["returncode"] == 0 else "absent"


def test_installed_packages_let_the_step_run_without_its_network_parts(guest: GuestController,
                                                                       cache: FileCache) -> None:
    # xdotool and python3-gi (PyGObject, which imports as gi) are among the desktop's own packages
    # (vm_images/desktop/packages.txt)
    assert _dpkg_status(guest, "xdotool").endswith(" installed"), "the desktop lacks xdotool"
    guest.execute(["rm", "-f", "/home/user/osf_after"])
    reports = executor(guest, cache).run([
        # chrome/6766f2b8's shape: the work after the install must still run (offline, the install
        # itself would fail and `&&` would skip it)
        {"type": "execute", "parameters": {"command": APT_UPDATE_INSTALL.replace("{PKG}", "xdotool"),
                                           "shell": True}},
        {"type": "command", "parameters": {"command": ["pip", "install", "PyGObject"]}},
        {"type": "execute", "parameters": {"command": "python3 -m pip install --user pygobject", "shell": True}},
    ])
    assert guest.get_file("/home/user/osf_after") == b"after\n"
    assert reports[0].detail == ("returncode 0; offline, left out `sudo -S apt-get update -y`, "
                                 "`sudo -S apt-get install xdotool -y` (xdotool installed)")
    assert reports[1].detail == "returncode 0; offline, left out `pip install PyGObject` (PyGObject installed)"
    assert reports[2].detail == ("returncode 0; offline, left out `python3 -m pip install --user pygobject` "
                                 "(pygobject installed)")


def test_a_missing_package_fails_the_step_naming_it(guest: GuestController, cache: FileCache) -> None:
    assert _dpkg_status(guest, "sysstat") in ("absent", "unknown ok not-installed"), "the desktop has sysstat"
    absent = guest.execute(["python3", "-c", "import fitz"])
    assert absent["returncode"] != 0, "the desktop's python3 has PyMuPDF (fitz)"
    guest.execute(["rm", "-f", "/home/user/osf_after"])
    # multi_apps/2373b66a's step, after one that runs
    steps = [{"type": "sleep", "parameters": {"seconds": 0.01}},
             {"type": "command", "parameters": {"command": "echo {CLIENT_PASSWORD} | sudo -S apt-get update && "
                                                           "echo {CLIENT_PASSWORD} | sudo -S apt-get install sysstat",
                                                "shell": True}}]
    with pytest.raises(SetupFailed) as ei:
        executor(guest, cache).run(steps, where="t.json: $.config")
    e = ei.value
    assert (e.index, e.type) == (1, "command")
    assert e.reason == ("t.json: $.config[1]: needs the network: apt package 'sysstat' is not installed and this "
                        "farm is offline (`sudo -S apt-get update`, `sudo -S apt-get install sysstat`)")
    # multi_apps/da922383's postconfig: PyMuPDF imports as fitz; pip knows it by its distribution name
    with pytest.raises(SetupFailed, match=r"postconfig\[0\]: needs the network: pip package 'PyMuPDF' is not "
                                          r"installed and this farm is offline \(`pip install PyMuPDF`\)"):
        executor(guest, cache).run([{"type": "execute", "parameters": {"command": "pip install PyMuPDF",
                                                                       "shell": "true"}}],
                                   where="t.json: $.evaluator.postconfig")
    # one of two missing is enough; a fetch fails before anything is looked up
    with pytest.raises(SetupFailed, match=r"needs the network: pip package 'no-such-dist-xyz' is not installed"):
        executor(guest, cache).run([{"type": "execute", "parameters": {
            "command": ["python3", "-m", "pip", "install", "pygobject", "no-such-dist-xyz"]}}])
    with pytest.raises(SetupFailed, match=r"`wget -q https://example.org/a.zip` fetches https://example.org/a.zip "
                                          r"\(wget\), and this farm is offline"):
        executor(guest, cache).run([{"type": "launch", "parameters": {
            "command": "wget -q https://example.org/a.zip && touch /home/user/osf_after", "shell": True}}])
    with pytest.raises(SetupFailed, match="cannot be left out on its own"):
        executor(guest, cache).run([{"type": "execute_with_verification", "parameters": {
            "command": "bash -c 'apt-get install -y xdotool && touch /home/user/osf_after'", "shell": True}}])
    assert guest.get_file("/home/user/osf_after") is None  # no step ran a part of its command
