"""The guest server: every OSWorld-compatible and /v1 route against one real desktop."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from osfarm.desktop.box.process_tree import descendants
from osfarm.testing.asset_server import HF, asset_server
from osfarm.testing.waiting import wait_until

TOKEN = "test-token-guest"
ROOT = Path(__file__).resolve().parent.parent
W, H = 1280, 800
TERM_TITLE = "ofterm"




class Guest:
    def __init__(self, tmp: Path, proc: subprocess.Popen[bytes], state: dict, client: httpx.Client):
        self.tmp, self.proc, self.state, self.c = tmp, proc, state, client


@pytest.fixture(scope="module")
def guest():  # noqa: ANN201
    tmp = Path(tempfile.mkdtemp(prefix="of", dir="/tmp"))
    home = tmp / "home"
    (home / "Desktop").mkdir(parents=True)
    # The image decides which app opens text files; here, a terminal titled with the file path
    # (Debian's default, vim in a terminal, does not put the file name in the window title).
    apps = home / ".local" / "share" / "applications"
    apps.mkdir(parents=True)
    (apps / "oftext.desktop").write_text(
        "[Desktop Entry]\nType=Application\nName=OF Text\nMimeType=text/plain;\n"
        "Exec=xfce4-terminal --disable-server --dynamic-title-mode=none --hold -T %f -x cat %f\n")
    (home / ".config").mkdir()
    (home / ".config" / "mimeapps.list").write_text("[Default Applications]\ntext/plain=oftext.desktop\n")
    sock, state_file = tmp / "g.sock", tmp / "state.json"
    # the download route may reach this test's loopback file server (and nothing else private)
    env = dict(os.environ, OSFARM_GUEST_TOKEN=TOKEN, OSFARM_DOWNLOAD_ALLOW_HOSTS="127.0.0.1")
    log = open(tmp / "session.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "osfarm.desktop.launch.launcher", "--width", str(W), "--height", str(H),
         "--socket", str(sock), "--state-file", str(state_file), "--home", str(home)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://guest",
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    try:
        wait_until(lambda: proc.poll() is not None or state_file.exists(), 60, "the session")
        assert proc.poll() is None, (tmp / "session.log").read_text()
        yield Guest(tmp, proc, json.loads(state_file.read_text()), client)
    finally:
        client.close()
        before = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(20) == 0
        finally:
            for pid in descendants(proc.pid) + [p for p in before if _alive(p)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def detail(r: httpx.Response) -> str:
    return r.json()["detail"]


def windows(g: Guest) -> list[dict]:
    r = g.c.get("/v1/observation", params={"screenshot": "false", "cursor": "false"})
    assert r.status_code == 200, r.text
    return r.json()["windows"]


def png(g: Guest) -> Image.Image:
    r = g.c.get("/screenshot")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    return Image.open(io.BytesIO(r.content)).convert("RGB")


# ------------------------------------------------------------------ auth and errors


def test_auth_required_everywhere(guest: Guest) -> None:
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(guest.tmp / "g.sock")), base_url="http://guest")
    for method, path in [("GET", "/v1/health"), ("GET", "/screenshot"), ("POST", "/execute"),
                         ("POST", "/setup/upload"), ("GET", "/no/such/route"), ("POST", "/v1/step")]:
        r = raw.request(method, path)
        assert r.status_code == 401, (path, r.status_code)
        assert "bearer token" in detail(r)
        assert r.headers["www-authenticate"] == "Bearer"
    assert raw.get("/v1/health", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert "invalid" in detail(raw.get("/v1/health", headers={"Authorization": "Bearer nope"}))
    assert raw.get("/v1/health", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    raw.close()


def test_health(guest: Guest) -> None:
    r = guest.c.get("/v1/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["display"] == guest.state["display"]
    assert h["screen"] == {"width": W, "height": H}
    assert h["pid"] == guest.proc.pid
    # the AT-SPI bus comes up in the background; the cached check turns true shortly after
    wait_until(lambda: guest.c.get("/v1/health").json()["a11y_bus"], 20, "a11y_bus true", 0.5)


@pytest.mark.parametrize("path", ["/execute", "/setup/execute", "/setup/launch", "/run_python",
                                  "/run_bash_script", "/list_directory", "/setup/open_file",
                                  "/setup/activate_window", "/setup/close_window",
                                  "/setup/change_wallpaper", "/execute_with_verification"])
def test_malformed_json_is_400(guest: Guest, path: str) -> None:
    r = guest.c.post(path, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and detail(r).startswith("body: invalid JSON")
    r = guest.c.post(path, json=[1, 2])
    assert r.status_code == 400 and "expected a JSON object" in detail(r)
    r = guest.c.post(path, json={})
    assert r.status_code == 400
    field = {"/run_python": "code", "/run_bash_script": "script", "/list_directory": "path",
             "/setup/open_file": "path", "/setup/change_wallpaper": "path",
             "/setup/activate_window": "window_name", "/setup/close_window": "window_name"}.get(path, "command")
    assert detail(r).startswith(f"{field}: "), detail(r)


# ------------------------------------------------------------------ simple info routes


def test_platform_screen_size_desktop_path(guest: Guest) -> None:
    assert guest.c.get("/platform").text == "Linux"
    assert guest.c.post("/screen_size").json() == {"width": W, "height": H}
    r = guest.c.post("/desktop_path")
    assert r.status_code == 200 and r.json() == {"desktop_path": str(guest.tmp / "home" / "Desktop")}


def test_wallpaper(guest: Guest) -> None:
    assert guest.c.post("/wallpaper").status_code == 404  # none set yet
    img = guest.tmp / "wall.png"
    Image.new("RGB", (64, 40), (200, 30, 40)).save(img)
    r = guest.c.post("/setup/change_wallpaper", json={"path": str(img)})
    assert r.status_code == 200, r.text
    got = guest.c.post("/wallpaper")
    assert got.status_code == 200 and got.content == img.read_bytes()
    # the root window shows it (top-left corner: no window there yet)
    assert png(guest).getpixel((5, 5)) == (200, 30, 40)
    assert guest.c.post("/setup/change_wallpaper", json={"path": "/nope.png"}).status_code == 404
    (guest.tmp / "notimg.png").write_text("hello")
    r = guest.c.post("/setup/change_wallpaper", json={"path": str(guest.tmp / "notimg.png")})
    assert r.status_code == 400 and detail(r).startswith("path: not an image")
    r = guest.c.post("/setup/change_wallpaper", json={"path": 5})
    assert r.status_code == 400 and detail(r) == "path: expected a string, got int"


def test_screenshot_route(guest: Guest) -> None:
    img = png(guest)
    assert img.size == (W, H)


# ------------------------------------------------------------------ commands


def test_execute(guest: Guest) -> None:
    (guest.tmp / "in.txt").write_text("from stdin redirect\n")
    r = guest.c.post("/execute", json={"command": f"tr a-z A-Z < {guest.tmp}/in.txt", "shell": True})
    assert r.status_code == 200
    assert r.json() == {"status": "success", "output": "FROM STDIN REDIRECT\n", "error": "", "returncode": 0}
    r = guest.c.post("/setup/execute", json={"command": "printf '%s|' 'a b' c"})  # shlex-split, no shell
    assert r.json()["output"] == "a b|c|"
    r = guest.c.post("/execute", json={"command": ["sh", "-c", "echo $DISPLAY; echo oops >&2; exit 3"]})
    body = r.json()
    assert body["output"] == guest.state["display"] + "\n" and body["error"] == "oops\n" and body["returncode"] == 3
    # a background child keeping stdout open does not hold the reply until the timeout
    t0 = time.monotonic()
    r = guest.c.post("/execute", json={"command": "sleep 30 & echo started", "shell": True})
    assert r.json()["output"] == "started\n" and time.monotonic() - t0 < 10
    r = guest.c.post("/execute", json={"command": "sleep 5", "shell": True, "timeout": 0.3})
    assert r.status_code == 200 and r.json()["status"] == "error" and r.json()["returncode"] == -1


@pytest.mark.parametrize("body, status, prefix", [
    ({"command": 12}, 400, "command: expected a string or a list of strings"),
    ({"command": ["ls", 3]}, 400, "command.1: expected a string"),
    ({"command": []}, 400, "command: must not be empty"),
    ({"command": "ls", "shell": "yes"}, 400, "shell: expected true or false"),
    ({"command": "ls 'unclosed"}, 400, "command: cannot split"),
    ({"command": ["/no/such/program"]}, 400, "command: cannot run"),
    ({"command": "ls", "timeout": -1}, 400, "timeout: must be in"),
])
def test_execute_bad_input(guest: Guest, body: dict, status: int, prefix: str) -> None:
    r = guest.c.post("/execute", json=body)
    assert r.status_code == status and detail(r).startswith(prefix), r.text


def test_execute_with_verification(guest: Guest) -> None:
    f = guest.tmp / "verified"
    r = guest.c.post("/execute_with_verification", json={
        "command": ["touch", str(f)], "verification": {"command_success": f"test -f {f}"}})
    assert r.status_code == 200 and r.json()["verification"] == "passed" and f.exists()
    r = guest.c.post("/setup/execute_with_verification", json={
        "command": "true", "verification": {"window_exists": "no-such-window-xyz"},
        "max_wait_time": 0.4, "check_interval": 0.1})
    assert r.status_code == 500 and r.json()["status"] == "verification_failed"
    r = guest.c.post("/execute_with_verification", json={"command": "true"})
    assert r.status_code == 200 and r.json()["status"] == "success"
    r = guest.c.post("/execute_with_verification", json={"command": "true", "verification": "x"})
    assert r.status_code == 400 and detail(r).startswith("verification: expected an object")


def test_run_python(guest: Guest) -> None:
    r = guest.c.post("/run_python",
                     json={"code": "import pyautogui, os\nprint(os.environ['DISPLAY'], pyautogui.size())"})
    body = r.json()
    assert body["status"] == "success" and body["return_code"] == 0
    assert body["output"].strip() == f"{guest.state['display']} Size(width={W}, height={H})"
    r = guest.c.post("/run_python", json={"code": "raise ValueError('bad thing')"})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "error" and "ValueError: bad thing" in body["error"]
    assert guest.c.post("/run_python", json={"code": 1}).status_code == 400


def test_run_bash_script_runs_once(guest: Guest) -> None:
    d = guest.tmp / "bash"
    d.mkdir()
    r = guest.c.post("/run_bash_script", json={"script": "echo run >> count; wc -l < count; echo err >&2",
                                               "working_dir": str(d)})
    assert r.status_code == 200
    assert r.json() == {"status": "success", "output": "1\nerr\n", "error": "", "returncode": 0}
    assert (d / "count").read_text() == "run\n"
    r = guest.c.post("/run_bash_script", json={"script": "exit 4"})
    assert r.json()["status"] == "error" and r.json()["returncode"] == 4
    r = guest.c.post("/run_bash_script", json={"script": "sleep 5", "timeout": 0.3})
    assert r.status_code == 200 and r.json()["returncode"] == -1 and "timed out" in r.json()["output"]
    r = guest.c.post("/run_bash_script", json={"script": "true", "working_dir": "/no/such/dir"})
    assert r.status_code == 400 and detail(r).startswith("working_dir: not a directory")
    r = guest.c.post("/run_bash_script", json={"script": "true", "timeout": "soon"})
    assert r.status_code == 400 and detail(r).startswith("timeout: expected a number")


# ------------------------------------------------------------------ files


def test_upload_then_file_and_list_directory(guest: Guest) -> None:
    payload = os.urandom(300_000) + b"<end>"
    target = guest.tmp / "home" / "up" / "deep" / "blob.bin"
    r = guest.c.post("/setup/upload", data={"file_path": "~/up/deep/blob.bin"},
                     files={"file_data": ("blob.bin", payload, "application/octet-stream")})
    assert r.status_code == 200 and r.text == f"File Uploaded: {len(payload)} bytes"
    assert target.read_bytes() == payload
    r = guest.c.post("/file", data={"file_path": str(target)})
    assert r.status_code == 200 and r.content == payload
    assert "attachment" in r.headers["content-disposition"]
    tree = guest.c.post("/list_directory", json={"path": "~/up"}).json()["directory_tree"]
    assert tree == {"type": "directory", "name": "up", "children": [
        {"type": "directory", "name": "deep", "children": [{"type": "file", "name": "blob.bin"}]}]}


def test_setup_download_file(guest: Guest) -> None:
    # OSWorld's route: the desktop itself downloads {url} to {path} (a task file names both).
    with asset_server({HF + "/a.bin": b"x" * 70_000}) as srv:
        srv.cut_once.add(HF + "/a.bin")  # a body cut short is detected and resumed
        r = guest.c.post("/setup/download_file", json={"url": srv.url(f"/redirect/2{HF}/a.bin"), "path": "~/dl/a.bin"})
        assert r.status_code == 200 and r.text == "File downloaded successfully: 70000 bytes"
        assert (guest.tmp / "home" / "dl" / "a.bin").read_bytes() == b"x" * 70_000 and srv.ranges == ["bytes=35000-"]
        assert sorted(p.name for p in (guest.tmp / "home" / "dl").iterdir()) == ["a.bin"]  # nothing else left
        r = guest.c.post("/setup/download_file", json={"url": srv.url(HF + "/gone"), "path": "~/dl/gone"})
        assert r.status_code == 500 and r.text.startswith(
            f"Failed to download {srv.url(HF + '/gone')}. No retries left.")
        assert "HTTP 404" in r.text and not list((guest.tmp / "home" / "dl").glob("gone*"))
        for url, words in ((srv.url("/to-file"), "url: only http and https URLs are downloaded, not 'file'"),
                           ("file:///etc/passwd", "url: only http and https"),
                           (srv.url("/to-private"), "url: host localhost is not on the allow-list")):
            r = guest.c.post("/setup/download_file", json={"url": url, "path": "~/dl/x"})
            assert r.status_code == 400 and detail(r).startswith(words), r.text
        r = guest.c.post("/setup/download_file", json={"path": "~/dl/x"})
        assert r.status_code == 400 and detail(r) == "url: required"
        r = guest.c.post("/setup/download_file", json={"url": srv.url(HF + "/a.bin"), "path": "~/dl"})
        assert r.status_code == 400 and detail(r).startswith("path: is a directory")


def test_file_routes_bad_input(guest: Guest) -> None:
    r = guest.c.post("/file", data={})
    assert r.status_code == 400 and detail(r) == "file_path: required (form field)"
    r = guest.c.post("/file", data={"file_path": "/no/such/file"})
    assert r.status_code == 404 and r.json()["error"] == "File not found"
    r = guest.c.post("/file", data={"file_path": "/tmp"})
    assert r.status_code == 400 and detail(r).startswith("file_path: is a directory")
    r = guest.c.post("/setup/upload", data={"file_path": str(guest.tmp / "x")})
    assert r.status_code == 400 and detail(r).startswith("file_data: required")
    r = guest.c.post("/setup/upload", data={"file_path": str(guest.tmp / "x"), "file_data": "plain"})
    assert r.status_code == 400 and detail(r).startswith("file_data: expected a file part")
    r = guest.c.post("/setup/upload", files={"file_data": ("a", b"x")})
    assert r.status_code == 400 and detail(r).startswith("file_path: required")
    r = guest.c.post("/list_directory", json={"path": "/etc/hostname"})
    assert r.status_code == 400 and detail(r).startswith("path: not a directory")
    r = guest.c.post("/window_size", data={})
    assert r.status_code == 400 and detail(r).startswith("app_class_name: required")
    r = guest.c.post("/window_size", data={"app_class_name": "NoSuchClass"})
    assert r.status_code == 404


# ------------------------------------------------------------------ apps, windows and input


@pytest.fixture(scope="module")
def terminal(guest: Guest) -> dict:
    r = guest.c.post("/setup/launch", json={"command": [
        "xfce4-terminal", "--disable-server", f"--title={TERM_TITLE}", "--dynamic-title-mode=none",
        "--geometry=80x20+0+0"]})
    assert r.status_code == 200 and r.text.startswith("xfce4-terminal --disable-server")
    w = guest.c.post("/v1/wait_for_window", json={"title": TERM_TITLE, "timeout": 60}).json()
    assert w["ok"], w
    win = next(x for x in windows(guest) if x["title"] == TERM_TITLE)
    return win


def test_step_click_and_typing_into_a_terminal(guest: Guest, terminal: dict) -> None:
    out = guest.tmp / "typed.txt"
    cx, cy = terminal["x"] + terminal["width"] // 2, terminal["y"] + terminal["height"] // 2
    r = guest.c.post("/v1/step", json={"actions": [
        {"action_type": "CLICK", "parameters": {"x": cx, "y": cy}},
        {"action_type": "TYPING", "parameters": {"text": f"echo 'a<b>c' \"$((6*7))\" > {out}"}},
        {"action_type": "PRESS", "parameters": {"key": "enter"}},
    ]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["ok"] for x in body["results"]] == [True, True, True] and body["done"] is None
    w = guest.c.post("/v1/wait_for_file", json={"path": str(out), "min_size": 1, "timeout": 20}).json()
    assert w["ok"], w
    wait_until(lambda: out.read_text() == "a<b>c 42\n", 5, "the typed command's output")
    assert guest.c.get("/cursor_position").json() == [cx, cy]


def test_step_observation_waits_for_the_screen_to_settle(guest: Guest, terminal: dict) -> None:
    import base64
    import io

    from PIL import Image, ImageChops

    before = Image.open(io.BytesIO(guest.c.get("/v1/screenshot", params={"cursor": "false"}).content)).convert("RGB")
    cx, cy = terminal["x"] + terminal["width"] // 2, terminal["y"] + terminal["height"] // 2
    r = guest.c.post("/v1/step", json={
        "actions": [{"action_type": "CLICK", "parameters": {"x": cx, "y": cy}},
                    {"action_type": "TYPING", "parameters": {"text": "echo settled-" + "x" * 40}}],
        "observe": {"format": "png", "settle_s": 3, "cursor": False, "windows": False},
    })
    assert r.status_code == 200, r.text
    after = Image.open(io.BytesIO(base64.b64decode(r.json()["observation"]["screenshot"]))).convert("RGB")
    # The typed text is on the returned screenshot: it was taken after the terminal repainted.
    box = ImageChops.difference(before, after).getbbox()
    assert box is not None, "the observation does not show the typed text"
    assert box[2] - box[0] > 100, f"only a sliver changed ({box}): captured before the repaint"
    guest.c.post("/v1/step", json={"actions": [{"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "c"]}}]})


def test_settled_observation_waits_while_a_desktop_app_is_busy(guest: Guest) -> None:
    # A busy app whose screen does not change (LibreOffice loading, under load) must not pass
    # for settled: its queued input is not handled yet.
    r = guest.c.post("/setup/launch", json={"command": "timeout 1.5 sh -c 'while :; do :; done'", "shell": True})
    assert r.status_code == 200
    t0 = time.monotonic()
    r = guest.c.post("/v1/step", json={"actions": ["WAIT"], "observe": {"settle_s": 8, "windows": False}})
    waited = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert waited > 1.0, f"the observation came after {waited:.2f} s, while the busy loop still ran"


def test_osfarm_settle_waits_for_a_painted_window_and_reports_a_missing_one(guest: Guest, terminal: dict) -> None:
    r = guest.c.post("/execute", json={"command": f"osfarm-settle --window '{TERM_TITLE}' --timeout 30", "shell": True})
    assert r.json()["returncode"] == 0, r.json()
    r = guest.c.post("/execute", json={"command": "osfarm-settle --window 'no such window' --timeout 1", "shell": True})
    out = r.json()
    assert out["returncode"] == 1 and "no window titled *no such window*" in out["error"] + out["output"], out


def test_painted_tells_a_blank_window_from_a_drawn_one() -> None:
    import numpy as np

    from osfarm.desktop.x11.settle import painted

    blank = np.full((200, 300, 4), 240, dtype=np.uint8)
    assert not painted(blank)
    drawn = blank.copy()
    drawn[::10, :, :3] = 0  # grid lines: a tenth of the rows
    drawn[:, ::10, :3] = 0
    assert painted(drawn)


def test_step_code_done_and_first_error(guest: Guest) -> None:
    r = guest.c.post("/v1/step", json={"actions": [
        "pyautogui.moveTo(33, 44)", {"action_type": "MOVE_TO", "parameters": {"x": 50, "y": 60}},
        {"code": "print('hi')"}, "WAIT", "DONE", "pyautogui.moveTo(1, 1)"]})
    body = r.json()
    assert r.status_code == 200 and body["done"] == "DONE"
    assert [x["ok"] for x in body["results"]] == [True] * 5
    assert body["results"][2]["output"] == "hi\n"
    assert guest.c.get("/cursor_position").json() == [50, 60]  # the action after DONE did not run
    r = guest.c.post("/v1/step", json={"actions": ["raise RuntimeError('boom')",
                                                   {"action_type": "MOVE_TO", "parameters": {"x": 5, "y": 5}}],
                                       "observe": {"format": "jpeg", "scale": 0.5, "windows": False}})
    body = r.json()
    assert len(body["results"]) == 1 and not body["results"][0]["ok"]
    assert "RuntimeError: boom" in body["results"][0]["error"]
    assert guest.c.get("/cursor_position").json() == [50, 60]
    obs = body["observation"]
    assert obs["format"] == "jpeg" and (obs["width"], obs["height"]) == (W // 2, H // 2)
    assert body["t_env_ms"] > 0
    r = guest.c.post("/v1/step", json={"actions": [{"action_type": "FAIL"}]})
    assert r.json()["done"] == "FAIL"


@pytest.mark.parametrize("body, status, prefix", [
    ({}, 422, "actions: Field required"),
    ({"actions": "CLICK"}, 422, "actions: "),
    ({"actions": []}, 422, "actions: "),
    ({"actions": [{"action_type": "FLY"}]}, 422, "actions.0.action_type: unknown action type 'FLY'"),
    ({"actions": [{"action_type": "CLICK", "parameters": {"x": W, "y": 10}}]}, 422,
     "actions.0.parameters.x: 1280 is off screen"),
    ({"actions": ["WAIT", {"action_type": "MOVE_TO", "parameters": {"x": 1, "y": -1}}]}, 422,
     "actions.1.parameters.y: -1 is off screen"),
    ({"actions": [{"action_type": "MOVE_TO", "parameters": {"x": "a", "y": 1}}]}, 422, "actions.0.parameters.x: "),
    ({"actions": [{"action_type": "PRESS", "parameters": {"key": "nokey"}}]}, 422, "actions.0.parameters.key: "),
    ({"actions": [7]}, 422, "actions.0: expected a computer_13 object"),
    ({"actions": ["WAIT"], "code_timeout": 0}, 422, "code_timeout: "),
])
def test_step_bad_input(guest: Guest, body: dict, status: int, prefix: str) -> None:
    r = guest.c.post("/v1/step", json=body)
    assert r.status_code == status and detail(r).startswith(prefix), r.text


def test_step_malformed_json(guest: Guest) -> None:
    r = guest.c.post("/v1/step", content=b'{"actions": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and detail(r).startswith("body: invalid JSON")


def test_window_routes(guest: Guest, terminal: dict) -> None:
    r = guest.c.post("/window_size", data={"app_class_name": "xfce4-terminal"})
    assert r.status_code == 200 and r.json()["width"] > 100 and r.json()["height"] > 100
    r = guest.c.post("/setup/activate_window", json={"window_name": TERM_TITLE, "strict": True})
    assert r.status_code == 200 and r.text == "Window activated successfully"
    assert next(w for w in windows(guest) if w["title"] == TERM_TITLE)["focused"]
    r = guest.c.post("/setup/activate_window", json={"window_name": "no-such-window-xyz"})
    assert r.status_code == 404 and detail(r).startswith("window_name: ")
    r = guest.c.post("/setup/activate_window", json={"window_name": TERM_TITLE, "strict": "yes"})
    assert r.status_code == 400 and detail(r).startswith("strict: expected true or false")
    r = guest.c.post("/setup/close_window", json={"window_name": TERM_TITLE, "by_class": 1})
    assert r.status_code == 400 and detail(r).startswith("by_class: ")


def test_open_file_then_close_window(guest: Guest) -> None:
    f = guest.tmp / "home" / "notes-of.txt"
    f.write_text("hello from osfarm\n")
    r = guest.c.post("/setup/open_file", json={"path": str(f), "timeout_seconds": 60})
    assert r.status_code == 200, r.text
    title = wait_until(lambda: next((w["title"] for w in windows(guest) if "notes-of" in w["title"]), None),
                       5, "the opened file's window")
    r = guest.c.post("/setup/close_window", json={"window_name": "notes-of"})
    assert r.status_code == 200 and r.text == "Window closed successfully."
    wait_until(lambda: all(w["title"] != title for w in windows(guest)), 20, "the window to close")
    r = guest.c.post("/setup/close_window", json={"window_name": "notes-of"})
    assert r.status_code == 404
    r = guest.c.post("/setup/open_file", json={"path": "/no/such/file-or-app"})
    assert r.status_code == 404 and detail(r).startswith("path: application/file not found")
    r = guest.c.post("/setup/open_file", json={"path": str(f), "timeout_seconds": "x"})
    assert r.status_code == 400 and detail(r).startswith("timeout_seconds: ")


def test_open_file_times_out(guest: Guest) -> None:
    # an executable on PATH that never opens a window: the call gives up after timeout_seconds
    t0 = time.monotonic()
    r = guest.c.post("/setup/open_file", json={"path": "true", "timeout_seconds": 0.5})
    assert r.status_code == 504 and time.monotonic() - t0 < 10


def test_accessibility_and_terminal(guest: Guest, terminal: dict) -> None:
    r = guest.c.get("/accessibility")
    assert r.status_code == 200, r.text
    at = r.json()["AT"]
    assert at.startswith("<desktop-frame") and "xfce4-terminal" in at
    r = guest.c.get("/terminal")
    assert r.status_code == 200 and r.json()["status"] == "success" and "output" in r.json()


# ------------------------------------------------------------------ observation and screenshots


@pytest.mark.parametrize("fmt, magic", [("png", b"\x89PNG"), ("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")])
def test_observation_formats(guest: Guest, fmt: str, magic: bytes) -> None:
    r = guest.c.get("/v1/observation", params={"format": fmt, "scale": 0.5, "quality": 60})
    assert r.status_code == 200, r.text
    obs = r.json()
    data = base64.b64decode(obs["screenshot"])
    assert data.startswith(magic) and obs["format"] == fmt
    assert Image.open(io.BytesIO(data)).size == (W // 2, H // 2) == (obs["width"], obs["height"])
    assert obs["screen"] == {"width": W, "height": H}
    assert isinstance(obs["cursor"], list) and isinstance(obs["windows"], list)
    assert obs["a11y"] is None and obs["t_ms"] > 0


def test_observation_with_a11y(guest: Guest) -> None:
    obs = guest.c.get("/v1/observation", params={"screenshot": False, "a11y": True}).json()
    assert obs["screenshot"] is None and obs["a11y"].startswith("<desktop-frame")


@pytest.mark.parametrize("params, prefix", [
    ({"scale": 2}, "scale: "), ({"scale": 0}, "scale: "), ({"format": "gif"}, "format: "),
    ({"quality": "high"}, "quality: "), ({"bogus": 1}, "bogus: unknown query parameter"),
])
def test_observation_bad_query(guest: Guest, params: dict, prefix: str) -> None:
    r = guest.c.get("/v1/observation", params=params)
    assert r.status_code == 422 and detail(r).startswith(prefix), r.text


def test_v1_screenshot(guest: Guest) -> None:
    r = guest.c.get("/v1/screenshot", params={"format": "jpeg", "scale": 0.25, "quality": 50})
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(r.content)).size == (W // 4, H // 4)
    r = guest.c.get("/v1/screenshot", params={"format": "webp"})
    assert r.headers["content-type"] == "image/webp" and Image.open(io.BytesIO(r.content)).size == (W, H)
    r = guest.c.get("/v1/screenshot", params={"format": "bmp"})
    assert r.status_code == 422 and detail(r).startswith("format: ")
    r = guest.c.get("/v1/screenshot", params={"scale": "-1"})
    assert r.status_code == 422 and detail(r).startswith("scale: ")


# ------------------------------------------------------------------ code, waits, recording


def test_pyautogui_route(guest: Guest) -> None:
    r = guest.c.post("/v1/pyautogui", json={"code": "pyautogui.moveTo(70, 80)\npyautogui.position()"})
    body = r.json()
    assert body["ok"] and "Point(x=70, y=80)" in body["output"]
    assert guest.c.get("/cursor_position").json() == [70, 80]
    body = guest.c.post("/v1/pyautogui", json={"code": "1/0"}).json()
    assert not body["ok"] and "ZeroDivisionError" in body["error"]
    # agent code often reads the screen through pyautogui (scrot underneath on Linux)
    body = guest.c.post("/v1/pyautogui",
                        json={"code": "print(pyautogui.screenshot().size, len(pyautogui.pixel(5, 5)))"}).json()
    assert body["ok"], body
    assert body["output"].strip() == f"({W}, {H}) 3", body
    r = guest.c.post("/v1/pyautogui", json={"code": ""})
    assert r.status_code == 422 and detail(r).startswith("code: ")
    r = guest.c.post("/v1/pyautogui", json={"cod": "x"})
    assert r.status_code == 422 and detail(r).startswith("code: Field required")


def test_wait_for_file_created_later(guest: Guest) -> None:
    f = guest.tmp / "later.txt"
    r = guest.c.post("/setup/launch", json={"command": f"sleep 0.4; echo done > {f}", "shell": True})
    assert r.status_code == 200
    w = guest.c.post("/v1/wait_for_file", json={"path": str(f), "min_size": 5, "timeout": 20}).json()
    assert w["ok"] and w["waited_s"] > 0.1
    w = guest.c.post("/v1/wait_for_file", json={"path": str(guest.tmp / "never"), "timeout": 0.3}).json()
    assert not w["ok"] and w["waited_s"] >= 0.3
    r = guest.c.post("/v1/wait_for_file", json={"path": "x", "min_size": -1})
    assert r.status_code == 422 and detail(r).startswith("min_size: ")


def test_wait_for_window_timeout(guest: Guest) -> None:
    t0 = time.monotonic()
    w = guest.c.post("/v1/wait_for_window", json={"title": "no-such-window-xyz", "timeout": 0.4}).json()
    assert not w["ok"] and 0.4 <= w["waited_s"] < 5 and time.monotonic() - t0 < 5
    r = guest.c.post("/v1/wait_for_window", json={"timeout": 1})
    assert r.status_code == 422 and detail(r).startswith("title: ")
    r = guest.c.post("/v1/wait_for_window", json={"title": "x", "timeout": "long"})
    assert r.status_code == 422 and detail(r).startswith("timeout: ")


def test_recording(guest: Guest) -> None:
    assert guest.c.post("/end_recording").status_code == 400
    r = guest.c.post("/start_recording")
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    assert guest.c.post("/start_recording").status_code == 400
    # move the pointer around so frames differ, then stop
    for i in range(10):
        guest.c.post("/v1/step",
                     json={"actions": [{"action_type": "MOVE_TO", "parameters": {"x": 100 + 40 * i, "y": 300}}]})
        png(guest)
    r = guest.c.post("/end_recording")
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert len(r.content) > 1000 and r.content[4:8] == b"ftyp"
    assert guest.c.post("/end_recording").status_code == 400
