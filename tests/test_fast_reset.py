"""Fast reset (issue 15): warm resets of sandbox desktops, their fingerprint, and CPU accounting.

One farm with ``reset_mode: warm`` and one desktop: each test dirties it through the guest (as an
agent would: files, a double-forked daemon, a process ignoring SIGTERM, the clipboard, a held
modifier key, windows, root properties), releases it, and checks that the warm reset gave back
the cold start's fingerprint, with no fallback. The deadline is generous (a loaded CI machine must
not turn a slow warm reset into a fallback); the hanging reset test shortens it for itself.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import typer

from osfarm.desktop.warm.fingerprint_diff import differences
from osfarm.farm import metrics
from osfarm.farm.server import FarmServer
from osfarm.testing.farms import running_farm

pytestmark = pytest.mark.timeout(600)

DIRTY = r"""
import os, subprocess, pyautogui
home = os.path.expanduser("~")
open(os.path.join(home, "Desktop", "dirty.txt"), "w").write("x")
os.makedirs(os.path.join(home, ".config", "dirtyapp"), exist_ok=True)
open(os.path.join(home, ".config", "dirtyapp", "rc"), "w").write("y")
open(os.path.join(home, ".bashrc"), "a").write("# dirt\n")
open("/tmp/dirty.tmp", "w").write("z")
os.makedirs("/dev/shm/dirtdir", exist_ok=True)
# a double-forked daemon and a process that ignores SIGTERM
subprocess.Popen(["sh", "-c", "(sleep 1000 &) ; exit 0"])
subprocess.Popen(["sh", "-c", "trap '' TERM; while true; do sleep 1; done"], start_new_session=True)
# clipboard, X root property, a window, a held modifier, the pointer
OWNER = ("from Xlib import display, X; import time; d = display.Display(); "
         "w = d.screen().root.create_window(0, 0, 1, 1, 0, 0); "
         "[w.set_selection_owner(d.intern_atom(s), X.CurrentTime) for s in ('CLIPBOARD', 'PRIMARY')]; "
         "d.flush(); time.sleep(1000)")
subprocess.Popen(["python3", "-c", OWNER])
subprocess.run(["xprop", "-root", "-f", "DIRTY_PROP", "8s", "-set", "DIRTY_PROP", "dirt"], check=False)
subprocess.Popen(["xterm", "-T", "dirty-window"]) if os.path.exists("/usr/bin/xterm") else None
subprocess.Popen(["xmessage", "dirty"]) if os.path.exists("/usr/bin/xmessage") else None
pyautogui.keyDown("shift")
pyautogui.mouseDown(300, 300)
pyautogui.moveTo(17, 23)
"""


@pytest.fixture(scope="module")
def warm_farm() -> Iterator[FarmServer]:
    # cold_every 0: every reset here must be a warm one (the tests count warm resets and fallbacks)
    with running_farm(prefix="osfw", pool_min=1, pool_max=1, reset_mode="warm", cold_every=0,
                      warm_reset_timeout_s=60.0) as server:
        yield server


def _client(farm: FarmServer) -> httpx.Client:
    return httpx.Client(base_url=farm.url, headers={"Authorization": f"Bearer {farm.token}"}, timeout=180)


def _lease(c: httpx.Client) -> str:
    r = c.post("/v1/desktops", json={"ttl_s": 300, "wait_s": 120})
    r.raise_for_status()
    return r.json()["id"]


def _fingerprint(c: httpx.Client, lease: str) -> dict:
    r = c.get(f"/v1/desktops/{lease}/guest/v1/session/fingerprint")
    r.raise_for_status()
    return r.json()


def _code(c: httpx.Client, lease: str, code: str) -> None:
    r = c.post(f"/v1/desktops/{lease}/guest/v1/pyautogui", json={"code": code, "timeout": 60})
    r.raise_for_status()
    assert r.json()["ok"], r.json()


def _count(name: str, label: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"reason" if "fallback" in name else "mode": label}) or 0.0


def test_dirty_then_warm_reset_equals_cold_start(warm_farm: FarmServer) -> None:
    with _client(warm_farm) as c:
        lease = _lease(c)
        cold = _fingerprint(c, lease)
        _code(c, lease, DIRTY)
        time.sleep(1.0)
        dirty = _fingerprint(c, lease)
        assert dirty["digest"] != cold["digest"]
        diff = differences(cold, dirty, limit=50)
        for part in ("files.home", "files./tmp", "processes", "x.pressed_keys", "x.selections", "x.root_properties"):
            assert any(d.startswith(part) for d in diff), (part, diff)
        warm_before = _count("osfarm_resets_total", "warm")
        c.delete(f"/v1/desktops/{lease}").raise_for_status()
        lease = _lease(c)
        after = _fingerprint(c, lease)
        assert after["digest"] == cold["digest"], differences(cold, after)
        assert _count("osfarm_resets_total", "warm") == warm_before + 1
        info = c.get(f"/v1/desktops/{lease}").raise_for_status().json()  # the lease (the episode record) says so
        assert info["reset_mode"] == "warm" and info["reset_fallback"] is None, info
        # the desktop still works: code runs, the old token is gone
        _code(c, lease, "import pyautogui; pyautogui.moveTo(5, 5)")
        c.delete(f"/v1/desktops/{lease}").raise_for_status()


TAMPER = r"""
import subprocess
# as the agent's root (sudo, OSWorld's password): a loader hook and a mount in the agent's world
for cmd in ("touch /etc/ld.so.preload", "mount -t tmpfs none /mnt"):
    subprocess.run(["sudo", "-S", "sh", "-c", cmd], input=b"password\n", check=True)
"""


def _release_expecting_a_cold_restart(c: httpx.Client, lease: str, cold: dict) -> None:
    """Release the dirtied desktop: its warm reset must see a mismatch and restart it cold, which
    gives the cold start's fingerprint back."""
    mismatches = _count("osfarm_warm_reset_fallbacks_total", "mismatch")
    c.delete(f"/v1/desktops/{lease}").raise_for_status()
    lease = _lease(c)
    assert _count("osfarm_warm_reset_fallbacks_total", "mismatch") == mismatches + 1
    info = c.get(f"/v1/desktops/{lease}").raise_for_status().json()
    assert info["reset_mode"] == "cold" and info["reset_fallback"] == "mismatch", info
    assert _fingerprint(c, lease)["digest"] == cold["digest"]
    c.delete(f"/v1/desktops/{lease}").raise_for_status()


def test_tampered_agent_world_falls_back_to_cold(warm_farm: FarmServer) -> None:
    """What a warm reset does not undo (the agent's own mounts and /etc layer, where its root could
    also hide a forged helper) shows in the fingerprint, seen from the kernel: the farm restarts cold."""
    with _client(warm_farm) as c:
        lease = _lease(c)
        cold = _fingerprint(c, lease)
        assert cold["agent_world"]["mounts"] and cold["agent_world"]["loader"]["ld.so.preload"] is None
        _code(c, lease, TAMPER)
        dirty = _fingerprint(c, lease)
        assert dirty["agent_world"]["loader"]["ld.so.preload"] is not None
        assert any("/mnt" in m for m in dirty["agent_world"]["mounts"])
        _release_expecting_a_cold_restart(c, lease, cold)


def test_changed_tree_root_falls_back_to_cold(warm_farm: FarmServer) -> None:
    """A scanned tree's own mode shows in the fingerprint (its "." row): the agent's root
    loosening or tightening the home (which the restore does not put back) forces a cold restart."""
    with _client(warm_farm) as c:
        lease = _lease(c)
        cold = _fingerprint(c, lease)
        _code(c, lease, 'import subprocess\nsubprocess.run(["sudo", "-S", "chmod", "0750", "/home/user"], '
                        'input=b"password\\n", check=True)')
        home = {e[0]: e for e in _fingerprint(c, lease)["files"]["home"]}
        assert home["."][2] == 0o750
        _release_expecting_a_cold_restart(c, lease, cold)


LEFT_BEHIND = r"""
import ctypes, os, subprocess, time
def sh(cmd, root=False):
    argv = ["sudo", "-S", "-p", "", "sh", "-c", cmd] if root else ["sh", "-c", cmd]
    subprocess.run(argv, input=b"password\n" if root else None, check=True, capture_output=True)
# a POSIX message queue (outlives its process, in no file tree the agent sees by default)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
assert rt.mq_open(b"/leftover", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0, ctypes.get_errno()
# X server settings that outlive their client: swapped buttons, no Control modifier, screen
# saver after 2 s, pointer acceleration, no autorepeat, bell, access control off, a red desktop
sh("xmodmap -e 'pointer = 3 2 1' -e 'clear control'")
sh("xset s 2 2 m 20 1 -r b 100 1000 100 c 100; xhost +; xsetroot -solid red")
# a client's window kept after it exits (RetainPermanent), hidden inside another client's window
sh("python3 -c 'from Xlib import display, X; d = display.Display(); d.set_close_down_mode(X.RetainPermanent); "
   "top = [w for w in d.screen().root.query_tree().children if w.get_attributes().map_state][0]; "
   "top.create_window(0, 0, 1, 1, 0, d.screen().root_depth); d.sync()'")
# the panel's window moved, a property on it (a message): a window the reset keeps
sh("python3 -c 'from Xlib import display, Xatom; d = display.Display(); "
   "[(w.change_property(d.intern_atom(\"LEFTOVER\"), Xatom.STRING, 8, b\"msg\"), w.configure(x=300, y=200)) "
   "for w in d.screen().root.query_tree().children if w.get_attributes().map_state]; d.sync()'")
# a timestamp as a message to the next episode, on a dir the reset keeps
sh("touch -d 2001-02-03 /run/user/1000", root=True)
# a process whose main thread exited (its stat says zombie) while a thread serves on loopback, and
# zombies named by the agent (a message in /proc for the next episode)
ZOMBIE = ("import ctypes, socket, threading, time\n"
          "def serve():\n"
          "    s = socket.socket(); s.bind(('127.0.0.1', 8081)); s.listen(); time.sleep(999)\n"
          "threading.Thread(target=serve).start(); time.sleep(0.3); ctypes.CDLL(None).pthread_exit(None)")
subprocess.Popen(["setsid", "python3", "-c", ZOMBIE])
sh("for i in 1 2 3; do (python3 -c 'import ctypes; ctypes.CDLL(None).prctl(15, b\"leftovermsg\")' &); done")
time.sleep(0.5)
# XKB: Caps Lock locked, then SlowKeys and StickyKeys on (the next episode's typing swallowed)
sh("xdotool key Caps_Lock")
x11 = ctypes.CDLL("libX11.so.6")
x11.XOpenDisplay.restype = ctypes.c_void_p
dpy = ctypes.c_void_p(x11.XOpenDisplay(None))
x11.XkbChangeEnabledControls(dpy, 0x100, 0xA, 0xA)
x11.XSync(dpy, 0)
"""

CHECK_LEFT = r"""
import ctypes, os, subprocess
rt = ctypes.CDLL("librt.so.1", use_errno=True)
assert rt.mq_open(b"/leftover", os.O_RDWR, 0o600, None) < 0, "the message queue is still there"
import socket
assert socket.socket().connect_ex(("127.0.0.1", 8081)) != 0, "a thread of a zombie leader survived"
stats = []
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            stats.append(open(f"/proc/{p}/stat").read())
        except OSError:
            pass
assert not [st for st in stats if "leftovermsg" in st or ") Z" in st], stats
out = subprocess.run("xmodmap -pp -pm; xset q; xhost", shell=True, capture_output=True, text=True).stdout
assert "Control_L" in out and "timeout:  600" in out and "auto repeat:  on" in out, out
assert "access control enabled" in out and "acceleration:  2/1" in out and "Caps Lock:   off" in out, out
assert [ln.split() for ln in out.splitlines() if ln.strip().startswith("1 ")][0] == ["1", "1"], out
assert os.stat("/run/user/1000").st_mtime > 1e9 + 1e8, "the kept dir's timestamp is the agent's"
from Xlib import display
d = display.Display()
tops = d.screen().root.query_tree().children
assert not [w for w in tops if w.get_full_property(d.intern_atom("LEFTOVER"), 0)]
assert not [w for w in tops if (w.get_geometry().x, w.get_geometry().y) == (300, 200)], "the panel stayed moved"
"""


def test_left_behind_in_kernel_and_x_server_warm_reset_away(warm_farm: FarmServer) -> None:
    """What outlives the agent's processes without being a file of its trees (a POSIX message
    queue, X server settings from xmodmap/xset/xhost, XKB controls and locks, X resources retained
    past their client, the panel's window moved and given a property, a kept dir's timestamp, a
    process whose main thread exited, zombies named by the agent) shows in the fingerprint and is
    undone by the warm reset (no fallback)."""
    with _client(warm_farm) as c:
        lease = _lease(c)
        cold = _fingerprint(c, lease)
        _code(c, lease, LEFT_BEHIND)
        dirty = _fingerprint(c, lease)
        assert dirty["files"]["/dev/mqueue"] != cold["files"]["/dev/mqueue"]
        for part in ("controls", "orphan_clients", "xkb", "windows", "background"):
            assert dirty["x"][part] != cold["x"][part], part
        assert dirty["x"]["xkb"]["state"] != cold["x"]["xkb"]["state"]
        warm_before = _count("osfarm_resets_total", "warm")
        c.delete(f"/v1/desktops/{lease}").raise_for_status()
        lease = _lease(c)
        assert _count("osfarm_resets_total", "warm") == warm_before + 1
        after = _fingerprint(c, lease)
        assert after["digest"] == cold["digest"], differences(cold, after)
        _code(c, lease, CHECK_LEFT)
        c.delete(f"/v1/desktops/{lease}").raise_for_status()


# settle code actions (issue 26): a child forked per action from the zygote, an app launched by
# one, and a child that clears the signal its zygote's death sends and outlives its timeout
SETTLE_ACTIONS = ["pyautogui.click(200, 200)",
                  "import subprocess; subprocess.Popen(['xmessage', 'settled'])",
                  "pyautogui.typewrite('abc'); pyautogui.press('enter')",
                  "import ctypes; ctypes.CDLL(None).prctl(1, 0); time.sleep(60)"]


def _kernel_timings(farm: FarmServer, desktop: str) -> list[str]:
    """The timings of the code runners running in a desktop's box (seen from the host)."""
    handle = farm.app.state.farm.pool._desktops[desktop].handle
    out = []
    for p in psutil.Process(handle.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(a.endswith("/osfarm_kernel.py") for a in p.cmdline()):
                out.append(p.environ().get("OSFARM_KERNEL_TIMING", "?"))
    return out


def test_warm_reset_after_settle_actions_stays_warm(warm_farm: FarmServer) -> None:
    """The settle timing's zygote (alive between actions, as the agent's user) and what its
    children left are the agent's processes like any other: the warm reset kills them and gives
    the cold start's fingerprint back, with no fallback."""
    with _client(warm_farm) as c:
        lease = _lease(c)
        cold = _fingerprint(c, lease)
        r = c.post(f"/v1/desktops/{lease}/step", json={"actions": SETTLE_ACTIONS, "timing": "settle",
                                                          "code_timeout": 2})
        results = r.raise_for_status().json()["results"]
        assert [a["ok"] for a in results] == [True, True, True, False], results
        warm_before = _count("osfarm_resets_total", "warm")
        c.delete(f"/v1/desktops/{lease}").raise_for_status()
        lease = _lease(c)
        info = c.get(f"/v1/desktops/{lease}").raise_for_status().json()
        assert info["reset_mode"] == "warm" and info["reset_fallback"] is None, info
        assert _count("osfarm_resets_total", "warm") == warm_before + 1
        after = _fingerprint(c, lease)  # it waits for the guest's start of the zygote in the background
        assert after["digest"] == cold["digest"], differences(cold, after)
        # the default timing's runner (settle's zygote) started again after the reset, before any
        # step asked for it; the fast one starts on its first use
        desktop = c.get(f"/v1/desktops/{lease}").raise_for_status().json()["desktop_id"]
        assert _kernel_timings(warm_farm, desktop) == ["settle"]
        r = c.post(f"/v1/desktops/{lease}/step", json={"actions": ["print('next')"]})
        assert r.raise_for_status().json()["results"][0]["output"] == "next\n"
        c.delete(f"/v1/desktops/{lease}").raise_for_status()


def test_cpu_accounting(warm_farm: FarmServer) -> None:
    with _client(warm_farm) as c:
        lease = _lease(c)
        _code(c, lease, "x = sum(i * i for i in range(3_000_000))")
        info = c.post(f"/v1/desktops/{lease}/heartbeat", json={}).raise_for_status().json()
        assert info["cpu_s"] is not None and info["cpu_s"] > 0.05, info
        c.delete(f"/v1/desktops/{lease}").raise_for_status()
        text = c.get("/metrics").text
        assert "osfarm_desktop_cpu_seconds_total" in text and 'osfarm_reset_cpu_seconds_count{mode="warm"}' in text


def test_fingerprint_command(warm_farm: FarmServer) -> None:
    from typer.testing import CliRunner

    from osfarm.cli import app

    with _client(warm_farm) as c:
        lease = _lease(c)
        args = ["desktop", "fingerprint", lease, "--url", warm_farm.url, "--token", warm_farm.token]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        fp = json.loads(r.stdout)
        assert fp["digest"] == _fingerprint(c, lease)["digest"]
        assert {"processes", "files", "x", "guest"} <= set(fp)
        assert any("Xvfb" in p for p in fp["processes"]) and "home" in fp["files"]
        c.delete(f"/v1/desktops/{lease}").raise_for_status()


def test_hanging_warm_reset_falls_back_to_cold(warm_farm: FarmServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The box's session stops answering (SIGSTOP): the warm reset is abandoned at its deadline
    and the desktop is restarted cold, counted as a timeout fallback."""
    state = warm_farm.app.state.farm
    for settings in {id(s): s for s in (state.settings, state.provider.settings)}.values():
        monkeypatch.setattr(settings, "warm_reset_timeout_s", 5.0)
    timeouts = _count("osfarm_warm_reset_fallbacks_total", "timeout")
    with _client(warm_farm) as c:
        lease = _lease(c)
        desktop = c.get(f"/v1/desktops/{lease}").raise_for_status().json()["desktop_id"]
        view = next(v for v in state.pool.desktops() if v.id == desktop)
        handle = state.pool._desktops[desktop].handle
        launcher = psutil.Process(handle.pid).children()[0]  # the box's PID 1: the session launcher
        assert view.state == "leased"
        launcher.suspend()
        try:
            t0 = time.monotonic()
            c.delete(f"/v1/desktops/{lease}").raise_for_status()
            lease = _lease(c)
            took = time.monotonic() - t0
        finally:
            with contextlib.suppress(psutil.Error):
                launcher.resume()
        assert _count("osfarm_warm_reset_fallbacks_total", "timeout") == timeouts + 1
        assert took < state.settings.warm_reset_timeout_s + state.settings.start_timeout_s
        _code(c, lease, "import pyautogui; pyautogui.moveTo(5, 5)")  # a working, cold-started desktop
        c.delete(f"/v1/desktops/{lease}").raise_for_status()


SUITE = Path(__file__).resolve().parent.parent / "suites" / "osfarm-offline"


@pytest.mark.timeout(900)
def test_offline_tasks_then_warm_reset_equal_cold_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks of the offline suite (their setup, then the replay agent's solution) on one desktop
    with warm resets: every reset's fingerprint equals the cold start's (a difference would be a
    counted fallback), every task is still solved, and each record says what its desktop cost."""
    from typer.testing import CliRunner

    from osfarm.runner.cli import eval_command

    index = json.loads((SUITE / "test_all.json").read_text())
    domains = ("os", "libreoffice_calc", "chrome", "gimp", "vlc", "thunderbird")
    (tmp_path / "index.json").write_text(json.dumps({d: index[d][:1] for d in domains}))
    state = tempfile.mkdtemp(prefix="ofw", dir="/tmp")  # short: guest sockets live under it
    monkeypatch.setenv("OSFARM_STATE_DIR", state)
    monkeypatch.setenv("OSFARM_RESET_MODE", "warm")
    monkeypatch.setenv("OSFARM_COLD_EVERY", "0")  # every reset proved by its fingerprint, none skipped
    fallbacks = sum(_count("osfarm_warm_reset_fallbacks_total", k) for k in ("mismatch", "error", "timeout"))
    warm = _count("osfarm_resets_total", "warm")
    app = typer.Typer()
    app.command()(eval_command)
    out = tmp_path / "run"
    try:
        res = CliRunner().invoke(app, ["--suite", str(SUITE), "--agent", "replay", "--envs", "1", "--out", str(out),
                                       "--no-progress", "--index", str(tmp_path / "index.json")])
    finally:
        shutil.rmtree(state, ignore_errors=True)
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    assert results["success_rate"] == 1.0 and results["infra_errors"] == 0, results["tasks"]
    assert sum(_count("osfarm_warm_reset_fallbacks_total", k) for k in ("mismatch", "error", "timeout")) == fallbacks
    assert _count("osfarm_resets_total", "warm") >= warm + len(domains) - 1
    records = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert all(r.get("desktop_cpu_s", 0) > 0 for r in records), [r.get("desktop_cpu_s") for r in records]
    resets = [r.get("desktop_reset") for r in records]  # a new box (start), then warm resets
    assert set(resets) <= {"start", "warm"} and "warm" in resets, resets
