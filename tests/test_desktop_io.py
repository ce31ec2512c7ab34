"""Display-side I/O against a real Xvfb + openbox + Tk app: capture, XTest input, EWMH windows,
and the long-lived pyautogui interpreter.

The Tk app (run with the system python3, which has python3-tk) logs every key/button/motion event
as a JSON line and mirrors its Text widget into a file, so tests read back exactly what arrived.
"""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from osfarm.desktop.box.coderunner import CodeRunner
from osfarm.desktop.x11 import ewmh
from osfarm.desktop.x11 import windows as win
from osfarm.desktop.x11.capture import ScreenCapture, encode_image
from osfarm.desktop.x11.xinput import InputController
from osfarm.schema.actions import ActionError, parse_action
from osfarm.testing.waiting import wait_until

SYS_PYTHON = "/usr/bin/python3"
W, H = 1280, 800



def _wait(pred: Callable[[], Any], timeout: float = 5.0, what: str | Callable[[], str] = "condition") -> Any:
    return wait_until(pred, timeout, what, interval=0.02)


TK_APP = r'''
import json, os, sys, tkinter as tk
title, cls, out_dir, delay = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
root = tk.Tk(className=cls)
root.title(title)
root.geometry("600x400+100+100")
text = tk.Text(root, font=("TkFixedFont", 14))
text.pack(fill="both", expand=True)
log = open(os.path.join(out_dir, "events.jsonl"), "a", buffering=1)
def emit(**kw):
    kw["t"] = round(__import__("time").monotonic(), 4); log.write(json.dumps(kw) + "\n")
def dump():
    tmp = os.path.join(out_dir, "text.tmp")
    content = text.get("1.0", "end-1c")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(content)
    os.replace(tmp, os.path.join(out_dir, "text.txt"))
    emit(ev="dump", n=len(content))
root.bind_all("<KeyPress>", lambda e: emit(ev="key", keysym=e.keysym, char=e.char, state=e.state))
root.bind_all("<KeyRelease>", lambda e: root.after_idle(dump))
root.bind_all("<ButtonPress>", lambda e: emit(ev="press", num=e.num, x=e.x_root, y=e.y_root, shift=bool(e.state & 1)))
root.bind_all("<ButtonRelease>", lambda e: emit(ev="release", num=e.num, x=e.x_root, y=e.y_root))
root.bind_all("<B1-Motion>", lambda e: emit(ev="drag", x=e.x_root, y=e.y_root))
root.bind_all("<Control-s>", lambda e: emit(ev="ctrl-s"))
def ready():
    text.focus_force()
    emit(ev="ready")
if delay > 0:
    root.withdraw()
    root.after(int(delay * 1000), lambda: (root.deiconify(), root.after(200, ready)))
else:
    root.after(200, ready)
root.mainloop()
'''




def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class TkApp:
    def __init__(self, display: str, tmp: Path, title: str, cls: str, delay: float = 0.0):
        self.dir = tmp / cls
        self.dir.mkdir(parents=True, exist_ok=True)
        script = tmp / "tkapp.py"
        script.write_text(TK_APP)
        env = {**os.environ, "DISPLAY": display}
        self.proc = subprocess.Popen([SYS_PYTHON, str(script), title, cls, str(self.dir), str(delay)], env=env)
        self.title = title

    def events(self) -> list[dict]:
        p = self.dir / "events.jsonl"
        if not p.exists():
            return []
        # The app appends as it goes: a last line without its newline is still being written.
        text = p.read_text()
        complete = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def mark(self) -> int:
        return len(self.events())

    def events_since(self, mark: int) -> list[dict]:
        return self.events()[mark:]

    def text(self) -> str:
        p = self.dir / "text.txt"
        return p.read_text(encoding="utf-8") if p.exists() else ""

    def wait_ready(self) -> None:
        _wait(lambda: any(e["ev"] == "ready" for e in self.events()), 10, "Tk app ready")

    def stop(self) -> None:
        _stop(self.proc)


@pytest.fixture(scope="module")
def xsession(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("xsession")
    r, w = os.pipe()
    xvfb = subprocess.Popen(
        ["Xvfb", "-displayfd", str(w), "-screen", "0", f"{W}x{H}x24", "-nolisten", "tcp"],
        pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    os.close(w)
    procs: list[subprocess.Popen] = [xvfb]
    apps: list[TkApp] = []
    try:
        # Xvfb writes "N\n" once it listens; read through the newline before closing our end,
        # or its second write() fails and the server aborts.
        buf = b""
        deadline = time.monotonic() + 10
        while not buf.endswith(b"\n"):
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, "Xvfb did not report its display"
            chunk = os.read(r, 64)
            assert chunk, "Xvfb exited before reporting its display"
            buf += chunk
        os.close(r)
        display = ":" + buf.decode().strip()
        env = {**os.environ, "DISPLAY": display, "HOME": str(tmp)}
        procs.append(subprocess.Popen(["openbox"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # openbox is ready once it advertises itself on the root window (EWMH).
        from Xlib import Xatom
        from Xlib import display as xdisplay

        d = xdisplay.Display(display)
        check = d.intern_atom("_NET_SUPPORTING_WM_CHECK")
        _wait(lambda: d.screen().root.get_full_property(check, Xatom.WINDOW), 10, "openbox")
        d.close()
        app = TkApp(display, tmp, "Osfarm Input Test", "Osfarmmain")
        apps.append(app)
        app.wait_ready()
        yield {"display": display, "tmp": tmp, "app": app, "apps": apps}
    finally:
        win.close_connections()
        for a in apps:
            a.stop()
        for p in reversed(procs):
            _stop(p)


@pytest.fixture(scope="module")
def ctl(xsession: dict[str, Any]) -> Iterator[InputController]:
    c = InputController(xsession["display"])
    yield c
    c.close()


@pytest.fixture(scope="module")
def cap(xsession: dict[str, Any]) -> Iterator[ScreenCapture]:
    c = ScreenCapture(xsession["display"])
    yield c
    c.close()


def act(ctl: InputController, raw: dict) -> None:
    ctl.execute(parse_action(raw))


def _focus_text(xsession: dict[str, Any], ctl: InputController) -> tuple[int, int]:
    """Activate the main app and click into its text widget; returns the click point."""
    app: TkApp = xsession["app"]
    assert win.activate_window(app.title, display=xsession["display"])
    w = win.find_window(title=app.title, display=xsession["display"])
    assert w is not None and w.focused
    pt = (w.x + w.width // 2, w.y + w.height // 2)
    act(ctl, {"action_type": "CLICK", "parameters": {"x": pt[0], "y": pt[1]}})
    return pt


def _clear_text(ctl: InputController, app: TkApp) -> None:
    # Tk Text: Control-/ selects all; Delete removes the selection. The app dumps its text after
    # each key release, so wait for a dump that follows the Delete.
    m = app.mark()
    act(ctl, {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "/"]}})
    act(ctl, {"action_type": "PRESS", "parameters": {"key": "delete"}})

    def cleared() -> bool:
        evs = app.events_since(m)
        i = next((k for k, e in enumerate(evs) if e.get("keysym") == "Delete"), None)
        return i is not None and any(e["ev"] == "dump" for e in evs[i:]) and app.text() == ""

    _wait(cleared, 5, lambda: f"text cleared, got {app.text()!r}")


# ---- capture --------------------------------------------------------------------------------


def test_capture_size_and_formats(cap: ScreenCapture) -> None:
    assert cap.size() == (W, H)
    img = cap.grab()
    assert img.mode == "RGB" and img.size == (W, H)
    magic = {"png": b"\x89PNG", "jpeg": b"\xff\xd8\xff", "webp": b"RIFF"}
    for fmt, head in magic.items():
        data = encode_image(img, fmt)
        assert data.startswith(head), fmt
        assert Image.open(io.BytesIO(data)).size == (W, H)
        half = encode_image(img, fmt, scale=0.5, quality=50)
        assert Image.open(io.BytesIO(half)).size == (W // 2, H // 2)
    assert encode_image(img, "png", png_level=9) != encode_image(img, "png", png_level=0)
    with pytest.raises(ValueError):
        encode_image(img, "gif")
    with pytest.raises(ValueError):
        encode_image(img, "png", scale=0)


def test_settle_finds_and_grabs_the_window_alone(xsession: dict[str, Any], cap: ScreenCapture) -> None:
    """osfarm-settle polls one window: its geometry from EWMH on one connection (as the guest's
    window list reports it) and a grab of that rectangle, equal to the same crop of a full frame."""
    from Xlib import display as xdisplay

    from osfarm.desktop.x11.settle import wait_settled

    app: TkApp = xsession["app"]
    d = xdisplay.Display(xsession["display"])
    try:
        geo = ewmh.client_geometry(d, app.title)
        w = win.find_window(title=app.title, display=xsession["display"])
        assert w is not None and geo == (w.x, w.y, w.width, w.height)
        assert ewmh.client_geometry(d, "osfarm input test") is None  # case-sensitive, like grep
        x, y, gw, gh = geo
        region = cap.grab_region(x, y, gw, gh)
        assert region is not None and (region.width, region.height) == (gw, gh)
        full = cap.grab_frame(cursor=False).pixels()
        assert (region.pixels() == full[y:y + gh, x:x + gw]).all()
        clipped = cap.grab_region(W - 10, H - 20, 100, 100)  # clipped to the screen
        assert clipped is not None and (clipped.width, clipped.height) == (10, 20)
        assert cap.grab_region(W + 5, 0, 10, 10) is None
        # the Tk app's empty Text widget is one colour: not painted yet, as far as settling goes
        assert wait_settled(app.title, 0.5, 0.1, cap, x=d) == "window not painted (one colour)"
        assert wait_settled("no such window", 0.3, 0.1, cap, x=d) == "no window titled *no such window*"
        striped = subprocess.Popen([SYS_PYTHON, "-c", STRIPED_APP], env={**os.environ, "DISPLAY": xsession["display"]})
        try:
            _wait(lambda: ewmh.client_geometry(d, "Osfarm Striped"), 10, "striped window")
            assert wait_settled("Osfarm Striped", 10, 0.3, cap, x=d) is None
        finally:
            _stop(striped)
    finally:
        d.close()


def test_wait_still_grabs_only_when_something_was_drawn(xsession: dict[str, Any], cap: ScreenCapture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A still screen settles without grabbing frames (the server reports drawing); a window
    that keeps drawing holds the wait until it stops, and past the timeout it does not settle."""
    grabs = []
    real = cap.grab_frame
    monkeypatch.setattr(cap, "grab_frame", lambda cursor=True: grabs.append(1) or real(cursor))
    assert cap.wait_still(5, quiet=0.3)
    assert len(grabs) <= 3, f"{len(grabs)} grabs of a still screen"
    env = {**os.environ, "DISPLAY": xsession["display"]}
    blink = subprocess.Popen([SYS_PYTHON, "-c", BLINK_APP, "1.5"], env=env)
    try:
        d = win.find_window  # the app is drawing once its window is listed
        _wait(lambda: d(title="Osfarm Blink", display=xsession["display"]), 10, "blinking window")
        assert not cap.wait_still(0.6, quiet=0.3), "settled while the window was still drawing"
        grabs.clear()
        t0 = time.monotonic()
        assert cap.wait_still(10, quiet=0.3)
        assert time.monotonic() - t0 > 0.4 and len(grabs) > 3  # it waited out the drawing, grabbing
    finally:
        _stop(blink)


BLINK_APP = """
import sys, time, tkinter as tk
root = tk.Tk()
root.title("Osfarm Blink")
root.geometry("200x200+900+300")
c = tk.Canvas(root, width=200, height=200, highlightthickness=0)
c.pack()
end = time.monotonic() + float(sys.argv[1])
def tick(i=0):
    c.configure(bg=("black", "white")[i % 2])
    if time.monotonic() < end:
        root.after(50, tick, i + 1)
root.after(0, tick)
root.mainloop()
"""


STRIPED_APP = """
import tkinter as tk
root = tk.Tk()
root.title("Osfarm Striped")
root.geometry("300x200+700+100")
c = tk.Canvas(root, width=300, height=200, bg="white", highlightthickness=0)
c.pack()
for i in range(0, 300, 10):
    c.create_rectangle(i, 0, i + 5, 200, fill="black", width=0)
root.mainloop()
"""


def test_capture_draws_cursor(cap: ScreenCapture, ctl: InputController) -> None:
    x, y = 1200, 700  # over the bare root window, away from the app
    act(ctl, {"action_type": "MOVE_TO", "parameters": {"x": x, "y": y}})
    with_cursor = cap.grab(cursor=True)
    without = cap.grab(cursor=False)
    box = (x - 16, y - 16, x + 16, y + 16)
    assert with_cursor.crop(box).tobytes() != without.crop(box).tobytes(), "no cursor drawn near the pointer"
    far = (10, 780, 60, 799)
    assert with_cursor.crop(far).tobytes() == without.crop(far).tobytes()


# ---- input ------------------------------------------------------------------------------------


def test_move_click_and_cursor_position(xsession: dict[str, Any], ctl: InputController) -> None:
    app: TkApp = xsession["app"]
    act(ctl, {"action_type": "MOVE_TO", "parameters": {"x": 5, "y": 6}})
    assert ctl.cursor_position() == (5, 6)
    w = win.find_window(title=app.title, display=xsession["display"])
    assert w is not None
    px, py = w.x + 50, w.y + 60
    m = app.mark()
    act(ctl, {"action_type": "CLICK", "parameters": {"x": px, "y": py, "button": "right"}})
    assert ctl.cursor_position() == (px, py)
    act(ctl, {"action_type": "CLICK", "parameters": {"num_clicks": 2}})  # at the current position
    act(ctl, {"action_type": "DOUBLE_CLICK", "parameters": {}})
    act(ctl, {"action_type": "MOUSE_DOWN", "parameters": {"button": "middle"}})
    act(ctl, {"action_type": "MOUSE_UP", "parameters": {"button": "middle"}})

    def presses() -> list[tuple[int, int, int]]:
        return [(e["num"], e["x"], e["y"]) for e in app.events_since(m) if e["ev"] == "press"]

    want = [(3, px, py), (1, px, py), (1, px, py), (1, px, py), (1, px, py), (2, px, py)]
    _wait(lambda: presses() == want, 5, lambda: f"presses {want}, got {presses()}")
    with pytest.raises(ActionError):
        act(ctl, {"action_type": "CLICK", "parameters": {"x": 5}})


def test_click_then_key_keeps_order(xsession: dict[str, Any], ctl: InputController) -> None:
    """openbox's synchronous button grab delays clicks; keys sent right after must not overtake."""
    app: TkApp = xsession["app"]
    w = win.find_window(title=app.title, display=xsession["display"])
    assert w is not None
    for i in range(5):
        m = app.mark()
        act(ctl, {"action_type": "CLICK", "parameters": {"x": w.x + 30 + 20 * i, "y": w.y + 30}})
        act(ctl, {"action_type": "PRESS", "parameters": {"key": "shift"}})

        def order(m: int = m) -> list[str]:
            return [e["ev"] for e in app.events_since(m) if e["ev"] in ("press", "release", "key")]

        _wait(lambda: len(order()) >= 3, 5, lambda: f"click + key, got {order()}")
        assert order() == ["press", "release", "key"]


def test_typing_is_exact(xsession: dict[str, Any], ctl: InputController) -> None:
    app: TkApp = xsession["app"]
    _focus_text(xsession, ctl)
    _clear_text(ctl, app)
    text = "Hello <World> ü!\nA~|{}\"'?:@#$%^&*()_+ é€ж\tend"
    m = app.mark()
    act(ctl, {"action_type": "TYPING", "parameters": {"text": text}})
    _wait(lambda: app.text() == text, 5, lambda: f"typed text, got {app.text()!r} {app.events_since(m)[-12:]}")
    # Typing again with the remapped keycodes still bound must reuse them.
    act(ctl, {"action_type": "TYPING", "parameters": {"text": "ü€"}})
    _wait(lambda: app.text() == text + "ü€", 5, lambda: f"second text, got {app.text()!r}")
    with pytest.raises(ActionError) as ei:
        act(ctl, {"action_type": "TYPING", "parameters": {"text": "a\x07b"}})
    assert ei.value.field == "parameters.text"


def test_press_keydown_hotkey(xsession: dict[str, Any], ctl: InputController) -> None:
    app: TkApp = xsession["app"]
    _focus_text(xsession, ctl)
    _clear_text(ctl, app)
    for key in ["<", ">", "A", "b", "enter", "space", "tab"]:
        act(ctl, {"action_type": "PRESS", "parameters": {"key": key}})
    _wait(lambda: app.text() == "<>Ab\n \t", 5, lambda: f"pressed keys, got {app.text()!r}")
    act(ctl, {"action_type": "PRESS", "parameters": {"key": "backspace"}})
    _wait(lambda: app.text() == "<>Ab\n ", 5, "backspace")
    m = app.mark()
    act(ctl, {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "s"]}})
    act(ctl, {"action_type": "KEY_DOWN", "parameters": {"key": "shift"}})
    act(ctl, {"action_type": "PRESS", "parameters": {"key": "f5"}})
    act(ctl, {"action_type": "KEY_UP", "parameters": {"key": "shift"}})
    act(ctl, {"action_type": "PRESS", "parameters": {"key": "pageup"}})

    def keys() -> list[tuple[str, bool]]:
        return [(e["keysym"], bool(e["state"] & 1)) for e in app.events_since(m) if e["ev"] == "key"]

    _wait(lambda: any(e["ev"] == "ctrl-s" for e in app.events_since(m)), 5, "ctrl-s binding")
    _wait(lambda: ("F5", True) in keys() and ("Prior", False) in keys(), 5, lambda: f"shift+F5 and Prior, got {keys()}")
    # The shift held by KEY_DOWN was released by KEY_UP: pageup arrived without it.
    m = app.mark()
    act(ctl, {"action_type": "PRESS", "parameters": {"key": "volumeup"}})  # a keysym the keymap has
    act(ctl, {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "F12"]}})  # names are case-insensitive
    _wait(lambda: "F12" in [k for k, _ in keys()], 5, lambda: f"F12, got {keys()}")
    with pytest.raises(ActionError) as ei:
        act(ctl, {"action_type": "PRESS", "parameters": {"key": "fn"}})  # no X keysym exists
    assert ei.value.field == "parameters.key"


def test_scroll_and_drag(xsession: dict[str, Any], ctl: InputController) -> None:
    app: TkApp = xsession["app"]
    w = win.find_window(title=app.title, display=xsession["display"])
    assert w is not None
    x0, y0 = w.x + 40, w.y + 40
    act(ctl, {"action_type": "MOVE_TO", "parameters": {"x": x0, "y": y0}})
    m = app.mark()
    act(ctl, {"action_type": "SCROLL", "parameters": {"dy": 2, "dx": -1}})
    act(ctl, {"action_type": "SCROLL", "parameters": {"dy": -3, "dx": 2}})

    def buttons() -> list[int]:
        return [(e["num"], e["shift"]) for e in app.events_since(m) if e["ev"] == "press"]

    # Tk 8.6 reports X buttons 6/7 (horizontal) as Shift + 4/5.
    up, down, left, right = (4, False), (5, False), (4, True), (5, True)
    want = [up, up, left, down, down, down, right, right]
    _wait(lambda: buttons() == want, 5, lambda: f"scroll buttons {want}, got {buttons()}")
    m = app.mark()
    x1, y1 = w.x + 300, w.y + 200
    act(ctl, {"action_type": "DRAG_TO", "parameters": {"x": x1, "y": y1}})
    assert ctl.cursor_position() == (x1, y1)

    def drag() -> list[dict]:
        return app.events_since(m)

    _wait(lambda: any(e["ev"] == "release" for e in drag()), 5, "drag release")
    evs = [{k: v for k, v in e.items() if k != "t"} for e in drag()]
    assert evs[0] == {"ev": "press", "num": 1, "x": x0, "y": y0, "shift": False}
    assert evs[-1] == {"ev": "release", "num": 1, "x": x1, "y": y1}
    # Motion with the button held (Tk compresses consecutive motion events into one or more).
    assert any(e["ev"] == "drag" for e in evs)


def test_control_actions_do_nothing(ctl: InputController) -> None:
    before = ctl.cursor_position()
    for at in ("WAIT", "DONE", "FAIL"):
        act(ctl, {"action_type": at})
    assert ctl.cursor_position() == before


# ---- windows -----------------------------------------------------------------------------


def test_list_activate_close_and_wait(xsession: dict[str, Any], ctl: InputController) -> None:
    display, main = xsession["display"], xsession["app"]
    ws = win.list_windows(display)
    m = next(w for w in ws if w.title == main.title)
    assert m.wm_class.lower().endswith(".osfarmmain")
    assert (m.width, m.height) == (600, 400)
    assert 0 <= m.x < W and 0 <= m.y < H
    assert win.window_size("OSFARMMAIN", display) == (600, 400)
    assert win.window_size("nope", display) is None
    assert win.find_window(title="input TEST", display=display) is not None
    assert win.find_window(title="input test", wm_class="nomatch", display=display) is None

    # A window that shows up later.
    t0 = time.monotonic()
    assert win.wait_for_window("never there", None, timeout=0.3, display=display) is None
    assert 0.3 <= time.monotonic() - t0 < 1.5
    late = TkApp(display, xsession["tmp"], "Late Window", "Osfarmlate", delay=0.6)
    xsession["apps"].append(late)
    t0 = time.monotonic()
    lw = win.wait_for_window("late window", "osfarmlate", timeout=15, display=display)
    assert lw is not None and lw.title == "Late Window"
    late.wait_ready()

    # wmctrl -a / -F / -x semantics.
    assert win.activate_window("Osfarm Input", display=display)
    assert win.find_window(title=main.title, display=display).focused  # type: ignore[union-attr]
    assert not win.activate_window("late window", strict=True, display=display)  # -F is exact, case-sensitive
    assert win.activate_window("Late Window", strict=True, display=display)
    assert win.find_window(title="Late Window", display=display).focused  # type: ignore[union-attr]
    assert win.activate_window("osfarmmain", by_class=True, display=display)
    assert win.find_window(title=main.title, display=display).focused  # type: ignore[union-attr]
    assert not win.activate_window("no such window", display=display)

    # wmctrl -c: graceful close; Tk's default WM_DELETE_WINDOW handler exits the app.
    assert win.close_window("Osfarmlate", by_class=True, display=display)
    late.proc.wait(timeout=10)
    _wait(lambda: win.find_window(title="Late Window", display=display) is None, 5, "late window gone")
    assert not win.close_window("Late Window", display=display)


# ---- code runner --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(xsession: dict[str, Any]) -> Iterator[CodeRunner]:
    r = CodeRunner(env={"DISPLAY": xsession["display"]})
    yield r
    r.close()


def test_coderunner_session(runner: CodeRunner) -> None:
    r = runner.run("x = 41\nprint('hi'); import sys; print('err', file=sys.stderr)")
    assert r.ok and r.error is None
    assert r.output == "hi\nerr\n"
    r = runner.run("x + 1")
    assert r.ok and r.output == "42\n"
    r = runner.run("import os; os.system('echo from-child')")
    assert r.ok and "from-child" in r.output
    r = runner.run("(pyautogui.PAUSE, pyautogui.FAILSAFE, pyautogui.size())")
    assert r.ok and r.output.strip() == f"(0, False, Size(width={W}, height={H}))"
    r = runner.run("print('before')\ndef f():\n    1/0\nf()")
    assert not r.ok and r.output == "before\n"
    assert r.error is not None and "ZeroDivisionError" in r.error and "1/0" in r.error
    assert "_run" not in r.error  # the kernel's own frame is hidden
    r = runner.run("syntax error here")
    assert not r.ok and "SyntaxError" in (r.error or "")
    assert runner.run("x").output == "41\n"  # state survived the errors


def test_coderunner_timeout_restarts(runner: CodeRunner) -> None:
    runner.run("y = 1")
    pid = runner.pid
    t0 = time.monotonic()
    r = runner.run("print('partial')\nimport time\ntime.sleep(30)", timeout=0.5)
    assert time.monotonic() - t0 < 3
    assert not r.ok and r.error == "timed out after 0.5 s"
    assert r.output == "partial\n"
    assert pid is not None and not _alive(pid)
    r = runner.run("'y' in globals()")
    assert r.ok and r.output == "False\n"  # a fresh interpreter
    assert runner.pid != pid
    r = runner.run("import os; os._exit(3)")
    assert not r.ok and "exit code 3" in (r.error or "")
    assert runner.run("1 + 1").output == "2\n"


def test_coderunner_pyautogui_types_less_than(
    xsession: dict[str, Any], ctl: InputController, runner: CodeRunner
) -> None:
    app: TkApp = xsession["app"]
    _focus_text(xsession, ctl)
    _clear_text(ctl, app)
    r = runner.run("pyautogui.write('a<b>C ü'); pyautogui.press('<'); pyautogui.hotkey('shift', ','); "
                   "pyautogui.press('enter')")
    assert r.ok, r.error
    _wait(lambda: app.text() == "a<b>C ü<<\n", 5, lambda: f"pyautogui text, got {app.text()!r}")


def test_coderunner_bad_python() -> None:
    r = CodeRunner(python="/nonexistent/python").run("1")
    assert not r.ok and "cannot start" in (r.error or "")
    # No display: pyautogui cannot import, and the runner says so instead of hanging.
    env = {"DISPLAY": ":9999"}
    r = CodeRunner(env=env).run("1", timeout=20)
    assert not r.ok and "pyautogui set-up failed" in (r.error or "")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); a reaped process does not.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
