"""The races of bench/action_timing.py: an agent's "do X, then type" on real apps of the desktop image.

Each race sets its app up once, then per round: ``prepare`` puts the app back in its starting
state (paced the OSWorld way, so it is not part of the race), ``code`` is the pyautogui block an
agent writes (run once per action timing), and ``landed`` says whether the typed token ended
where the agent meant it to ("right"), read from the app itself: a state file the toolkit apps
write, the accessibility tree, a window title, a file the typed command wrote. Tokens are fresh
per round, so a wrong round never makes a later one look right.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

from osfarm.client import FarmUnreachableError, RemoteDesktop
from osfarm.testing.race_dialog import TK_RACE_DIALOG

PYTHON = "python3"  # the desktop's interpreter: this bench's venv is not inside the box
CLICK_DELAY_MS = 60  # how late the Tk dialog moves its focus after a click (a slow app)
DIALOG_TITLE = "Find and Replace"  # LibreOffice's (the Tk and GTK windows' titles only contain it)


# The same two fields in a GTK 3 window with GTK's own click handling (no added delay): the race
# is the window manager's, the window is not focused when the click arrives.
GTK_DIALOG = r"""
import json, os, sys, gi
gi.require_version("Gtk", "3.0")
from gi.repository import Gtk, GLib
STATE = sys.argv[1]
win = Gtk.Window(title="GTK Find and Replace"); win.move(700, 40)
grid = Gtk.Grid(row_spacing=8, column_spacing=8, margin=8); win.add(grid)
find, repl = Gtk.Entry(width_chars=30), Gtk.Entry(width_chars=30)
grid.attach(Gtk.Label(label="Find"), 0, 0, 1, 1); grid.attach(find, 1, 0, 1, 1)
grid.attach(Gtk.Label(label="Replace"), 0, 1, 1, 1); grid.attach(repl, 1, 1, 1, 1)
def geom(w):
    _, x, y = w.get_window().get_origin(); a = w.get_allocation()  # a: in the toplevel's window
    return {"x": x + a.x + a.width // 2, "y": y + a.y + a.height // 2}
def save(*_):
    if not repl.get_realized():
        return True
    with open(STATE + ".tmp", "w") as f:
        json.dump({"find": find.get_text(), "replace": repl.get_text(), "at": geom(repl), "find_at": geom(find)}, f)
    os.replace(STATE + ".tmp", STATE)
    return True
def reset():
    if os.path.exists(STATE + ".reset"):
        os.unlink(STATE + ".reset")
        find.set_text(""); repl.set_text(""); find.grab_focus(); save()
    return True
find.connect("changed", save); repl.connect("changed", save)
GLib.timeout_add(200, save); GLib.timeout_add(20, reset)
win.connect("destroy", Gtk.main_quit); win.show_all(); Gtk.main()
"""

# The editable text fields of one LibreOffice window (by title) through AT-SPI, top to bottom:
# run inside the box, as the guest's whole-desktop tree takes seconds more with Writer open.
LO_FIELDS = r"""
import json, sys, pyatspi
def walk(node, out, depth=0):
    if depth > 30: return
    try:
        role = node.getRole()
    except Exception:
        return
    if role == pyatspi.ROLE_TEXT:
        st = node.getState()
        if st.contains(pyatspi.STATE_EDITABLE) and st.contains(pyatspi.STATE_SHOWING):
            e = node.queryComponent().getExtents(pyatspi.DESKTOP_COORDS)
            t = node.queryText()
            out.append({"x": e.x + e.width // 2, "y": e.y + e.height // 2, "text": t.getText(0, -1)})
    for i in range(node.childCount):
        walk(node.getChildAtIndex(i), out, depth + 1)
out = []
for app in pyatspi.Registry.getDesktop(0):
    if app is None or "soffice" not in (app.name or "").lower(): continue
    for w in app:
        if w is not None and w.name == sys.argv[1]:
            walk(w, out)
print(json.dumps(sorted(out, key=lambda f: (f["y"], f["x"]))))
"""


def execute(desk: RemoteDesktop, *command: str) -> dict[str, Any]:
    r = desk.guest("POST", "/setup/execute", json={"command": list(command)})
    out: dict[str, Any] = r.json()
    return out


def launch(desk: RemoteDesktop, *command: str) -> None:
    desk.guest("POST", "/setup/launch", json={"command": list(command)})


def osworld_step(desk: RemoteDesktop, code: str) -> None:
    """A preparation step, paced the OSWorld way (not part of the race)."""
    res = desk.step([code], timing="osworld")
    assert res.results[0].ok, res.results[0].error


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 90.0, fail: bool = True) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.3)
    if not fail:
        return None
    raise RuntimeError(f"{what} did not happen in {timeout_s:.0f} s")


def window(desk: RemoteDesktop, title: str, exact: bool = False) -> dict[str, int] | None:
    """Centre and top left of the first window whose title holds (or, ``exact``, is) ``title``."""
    for w in desk.observe(screenshot=False, windows=True, cursor=False).windows or []:
        if w.title == title or (not exact and title in w.title):
            return {"x": w.x + w.width // 2, "y": w.y + w.height // 2, "left": w.x, "top": w.y}
    return None


def window_titles(desk: RemoteDesktop) -> list[str]:
    return [w.title for w in desk.observe(screenshot=False, windows=True, cursor=False).windows or []]


def a11y_nodes(desk: RemoteDesktop) -> list[ET.Element]:
    xml = desk.guest("GET", "/accessibility").json()["AT"]
    return list(ET.fromstring(xml).iter())


def attr(node: ET.Element, suffix: str) -> str | None:
    return next((v for k, v in node.attrib.items() if k.endswith(suffix)), None)


def centre(node: ET.Element) -> tuple[int, int]:
    x, y = (int(v) for v in (attr(node, "screencoord") or "(0, 0)").strip("()").split(","))
    w, h = (int(v) for v in (attr(node, "size") or "(0, 0)").strip("()").split(","))
    return x + w // 2, y + h // 2


class Race:
    name = ""
    what = ""

    def setup(self, desk: RemoteDesktop) -> None: ...

    def prepare(self, desk: RemoteDesktop) -> None: ...

    def code(self, token: str) -> str:
        raise NotImplementedError

    def landed(self, desk: RemoteDesktop, token: str) -> bool:
        raise NotImplementedError

    def close(self, desk: RemoteDesktop) -> None: ...


class FieldsApp(Race):
    """Click the "Replace" field of a two-field app that writes its state to a file, then type."""

    state = ""

    def read(self, desk: RemoteDesktop) -> dict[str, Any]:
        for _ in range(20):
            try:
                r = desk.guest("POST", "/file", data={"file_path": self.state}, check=False)
            except FarmUnreachableError:  # the file was replaced while being sent: read it again
                continue
            got: dict[str, Any] = json.loads(r.content) if r.status_code == 200 else {}
            return got
        raise RuntimeError(f"cannot read {self.state}")

    def reset(self, desk: RemoteDesktop) -> None:
        execute(desk, "touch", self.state + ".reset")
        def done() -> bool:  # the app took the request (removed the file) and its fields are empty
            gone = execute(desk, "test", "-e", self.state + ".reset")["returncode"] != 0
            return gone and not self.read(desk).get("replace")
        wait_for(f"{self.name} reset", done, 20)

    def code(self, token: str) -> str:
        return f"pyautogui.click({self.at['x']}, {self.at['y']}); pyautogui.typewrite('{token}')"

    def landed(self, desk: RemoteDesktop, token: str) -> bool:
        time.sleep(0.5)  # let a deferred focus change and the saves happen
        return bool(self.read(desk).get("replace") == token)

    at: dict[str, int] = {}


class TkDialog(FieldsApp):
    name = "Tk dialog"
    what = f"click Replace, type (the app moves focus {CLICK_DELAY_MS} ms after the click)"
    state = "/home/user/race_tk.json"

    def setup(self, desk: RemoteDesktop) -> None:
        launch(desk, PYTHON, "-c", TK_RACE_DIALOG, self.state, str(CLICK_DELAY_MS))
        self.at = wait_for("the Tk dialog start", lambda: self.read(desk).get("at"), 60)

    def prepare(self, desk: RemoteDesktop) -> None:
        self.reset(desk)


class GtkDialog(FieldsApp):
    name = "GTK dialog"
    what = "click Replace in an unfocused GTK window, type"
    state = "/home/user/race_gtk.json"

    def setup(self, desk: RemoteDesktop) -> None:
        launch(desk, PYTHON, "-c", GTK_DIALOG, self.state)
        wait_for("the GTK dialog start", lambda: self.read(desk).get("at"), 60)
        time.sleep(1.0)  # the window manager places it; read where it ended up
        self.at = self.read(desk)["at"]

    def prepare(self, desk: RemoteDesktop) -> None:
        self.reset(desk)
        osworld_step(desk, f"pyautogui.click({TK_RACE.read(desk)['find_at']['x']}, "
                           f"{TK_RACE.read(desk)['find_at']['y']})")  # the focus is elsewhere


TK_RACE = TkDialog()


class Terminal(Race):
    """Click into a terminal while another one has the focus, type a command at once."""

    name = "terminal"
    what = "click an unfocused terminal, type a command and Enter"

    def setup(self, desk: RemoteDesktop) -> None:
        for side in ("A", "B"):
            execute(desk, "mkdir", "-p", f"/home/user/term{side}")
            launch(desk, "xfce4-terminal", "--disable-server", f"--title=race-term-{side}",
                   f"--working-directory=/home/user/term{side}", "--geometry=70x12")
        self.a = wait_for("terminal A", lambda: window(desk, "race-term-A"))
        self.b = wait_for("terminal B", lambda: window(desk, "race-term-B"))
        if self.a == self.b:
            raise RuntimeError("the two terminals overlap")

    def prepare(self, desk: RemoteDesktop) -> None:
        osworld_step(desk, f"pyautogui.click({self.b['x']}, {self.b['y']})")

    def code(self, token: str) -> str:
        return f"pyautogui.click({self.a['x']}, {self.a['y']}); pyautogui.typewrite('echo {token} > race.txt\\n')"

    def landed(self, desk: RemoteDesktop, token: str) -> bool:
        def wrote() -> bool:
            return token in execute(desk, "cat", "/home/user/termA/race.txt").get("output", "")
        return bool(wait_for("the command", wrote, 3, fail=False))

    def close(self, desk: RemoteDesktop) -> None:
        execute(desk, "pkill", "-f", "race-term-")


class Chromium(Race):
    """Ctrl+L then type a URL and Enter: the page must load what was typed."""

    name = "Chromium address bar"
    what = "ctrl+L, type a data: URL, Enter; the tab's title must be the typed one"

    def setup(self, desk: RemoteDesktop) -> None:
        launch(desk, "chromium", "--no-first-run", "--no-default-browser-check", "--password-store=basic",
               "--window-position=100,100", "--window-size=900,600", "data:text/html,<title>race-start</title>")
        self.win = wait_for("Chromium's window", lambda: window(desk, "race-start"), 90)

    def prepare(self, desk: RemoteDesktop) -> None:
        osworld_step(desk, f"pyautogui.click({self.win['x']}, {self.win['y'] + 100})")  # the page has the focus

    def code(self, token: str) -> str:
        return (f"pyautogui.hotkey('ctrl', 'l'); "
                f"pyautogui.typewrite('data:text/html,<title>{token}</title>\\n')")

    def landed(self, desk: RemoteDesktop, token: str) -> bool:
        return bool(wait_for("the page", lambda: any(token in t for t in window_titles(desk)), 4, fail=False))

    def close(self, desk: RemoteDesktop) -> None:
        execute(desk, "pkill", "-f", "chromium")


class WriterFindReplace(Race):
    """LibreOffice Writer's Find & Replace dialog (ctrl+H), through its accessibility tree."""

    name = "LibreOffice dialog"
    what = "Find & Replace open, the document focused: click the Replace field, type"
    opened = False

    def setup(self, desk: RemoteDesktop) -> None:
        launch(desk, "soffice", "--writer", "--norestore", "--nologo")
        self.win = wait_for("LibreOffice Writer's window", lambda: window(desk, "LibreOffice Writer"), 120)
        for _ in range(10):  # its first keys can go before the document is ready for them
            time.sleep(2.0)
            osworld_step(desk, f"pyautogui.click({self.win['x']}, {self.win['y']}); pyautogui.hotkey('ctrl', 'h')")
            if wait_for("the Find & Replace dialog", lambda: window(desk, DIALOG_TITLE, exact=True), 3, fail=False):
                break
        self.find, self.repl = wait_for("the dialog's fields", lambda: self.fields(desk), 30)

    def fields(self, desk: RemoteDesktop) -> tuple[tuple[int, int], tuple[int, int]] | None:
        found = self.texts(desk)
        return (found["find"][0], found["replace"][0]) if "find" in found and "replace" in found else None

    def texts(self, desk: RemoteDesktop) -> dict[str, tuple[tuple[int, int], str]]:
        """The dialog's Find and Replace fields (its first two, top to bottom): centre and text."""
        r = execute(desk, PYTHON, "-c", LO_FIELDS, DIALOG_TITLE)
        fields = json.loads(r["output"] or "[]") if r["returncode"] == 0 else []
        return {name: ((f["x"], f["y"]), f["text"]) for name, f in zip(("find", "replace"), fields, strict=False)}

    def prepare(self, desk: RemoteDesktop) -> None:
        # the document's window has the focus (a click left of the dialog): the click on the dialog's
        # field must move it back through the window manager, then the keys must follow
        osworld_step(desk, f"pyautogui.click({self.win['left'] + 60}, {self.win['y']})")

    def code(self, token: str) -> str:
        return f"pyautogui.click({self.repl[0]}, {self.repl[1]}); pyautogui.typewrite('{token}')"

    def landed(self, desk: RemoteDesktop, token: str) -> bool:
        time.sleep(0.3)
        found = self.texts(desk)
        return token in found.get("replace", ((0, 0), ""))[1] and token not in found.get("find", ((0, 0), ""))[1]


class WriterDialogOpens(WriterFindReplace):
    """Type right after a window opens: ctrl+H opens Find & Replace, the text goes to its Find field."""

    name = "typing as a window opens"
    what = "LibreOffice Writer: ctrl+H, type at once (into the dialog's Find field)"

    def setup(self, desk: RemoteDesktop) -> None:
        self.win = wait_for("LibreOffice Writer's window", lambda: window(desk, "LibreOffice Writer"), 120)

    def prepare(self, desk: RemoteDesktop) -> None:
        for _ in range(5):  # Escape closes the dialog when the focus is in it: click its Find field first
            if not window(desk, DIALOG_TITLE, exact=True):
                break
            at = self.fields(desk)
            click = f"pyautogui.click({at[0][0]}, {at[0][1]}); " if at else ""
            osworld_step(desk, click + "pyautogui.press('escape')")
            wait_for("the dialog to close", lambda: not window(desk, DIALOG_TITLE, exact=True), 3, fail=False)
        else:
            raise RuntimeError("the Find & Replace dialog does not close")
        osworld_step(desk, f"pyautogui.click({self.win['x']}, {self.win['y']}); pyautogui.hotkey('ctrl', 'a'); "
                           "pyautogui.press('delete')")

    def code(self, token: str) -> str:
        return f"pyautogui.hotkey('ctrl', 'h'); pyautogui.typewrite('{token}')"

    def landed(self, desk: RemoteDesktop, token: str) -> bool:
        wait_for("the dialog", lambda: window(desk, DIALOG_TITLE, exact=True), 10, fail=False)
        time.sleep(0.5)  # its fields are filled in once it shows
        found = self.texts(desk)
        return token in found.get("find", ((0, 0), ""))[1]

    def close(self, desk: RemoteDesktop) -> None:
        execute(desk, "pkill", "-f", "soffice")


RACES: list[Race] = [TK_RACE, GtkDialog(), WriterFindReplace(), WriterDialogOpens(), Chromium(), Terminal()]


def select_races(only: list[str] | None) -> list[Race]:
    """The races whose names hold one of the words of ``only`` (all with None), in RACES' order; the
    Tk dialog always (the GTK race uses it), and the LibreOffice dialog race with "typing as a window
    opens" (that one opens its dialog in the Writer the other starts)."""
    races = [r for r in RACES if only is None or r is TK_RACE or any(o in r.name.lower() for o in only)]
    if any(isinstance(r, WriterDialogOpens) for r in races):
        races = [r for r in RACES if r in races or type(r) is WriterFindReplace]
    return races
