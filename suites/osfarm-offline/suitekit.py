"""The vocabulary the domain modules of this suite write tasks with.

A domain module (domains/<name>.py) defines ``build(kit)``: it makes the input and gold files of
its tasks with ``kit.text``/``kit.xlsx``/``kit.path`` (under cache/<task_id>/, OSWorld's offline
cache layout) and declares each task with ``kit.task``.  The helpers below are the setup and
evaluator steps tasks share.  Nothing is ever downloaded: every URL of the suite
(https://osfarm.invalid/offline/<task_id>/<name>) resolves from the cache.
"""
from __future__ import annotations

import json
import re
import zipfile
from datetime import datetime
from pathlib import Path
from typing import Any

import openpyxl

URL = "https://osfarm.invalid/offline/{}/{}"


FIXED_TIME = datetime(2024, 1, 1)


def _freeze_zip(path: Path) -> None:
    """Rewrite a zip-based document (xlsx, docx, pptx, ...) with fixed entry times, so that a
    rebuild of the suite gives the same bytes and git sees no change."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    tmp = path.with_suffix(path.suffix + ".tmp")
    with zipfile.ZipFile(tmp, "w") as out:
        for info, data in entries:
            if info.filename == "docProps/core.xml":  # the writers stamp the save time here
                data = re.sub(rb"(<dcterms:(?:created|modified)[^>]*>)[^<]*", rb"\g<1>2024-01-01T00:00:00Z", data)
            fixed = zipfile.ZipInfo(info.filename, date_time=FIXED_TIME.timetuple()[:6])
            fixed.compress_type = zipfile.ZIP_DEFLATED
            fixed.external_attr = info.external_attr
            out.writestr(fixed, data)
    tmp.replace(path)


class SuiteKit:
    """Collects the tasks of every domain module and writes the suite folder."""

    def __init__(self, root: Path):
        self.root = root
        self.cache = root / "cache"
        self.index: dict[str, list[str]] = {}
        self.files: dict[Path, bytes] = {}
        self.assets: set[Path] = set()

    # -- files under cache/<task_id>/ ----------------------------------------------------------

    def path(self, task_id: str, name: str) -> Path:
        """Where an asset lives; a module that builds a file itself (docx, pptx, png) saves here."""
        p = self.cache / task_id / name
        p.parent.mkdir(parents=True, exist_ok=True)
        self.assets.add(p)
        return p

    def text(self, task_id: str, name: str, body: str) -> None:
        self.path(task_id, name).write_text(body)

    def xlsx(self, task_id: str, name: str, rows, extra: dict[str, Any] | None = None) -> None:
        wb = openpyxl.Workbook()
        ws = wb.active
        ws.title = "Sheet1"
        for r in rows:
            ws.append(list(r))
        for cell, value in (extra or {}).items():
            ws[cell] = value
        wb.save(self.path(task_id, name))

    # -- tasks ----------------------------------------------------------------------------------

    def task(self, domain: str, tid: str, instruction: str, config: list, evaluator: dict,
             steps: list, apps: list[str], source: str = "osfarm-offline") -> None:
        """Declare one task; ``steps`` is its reference solution, one list of actions per step."""
        if any(tid in ids for ids in self.index.values()):
            raise ValueError(f"task id {tid} declared twice")
        task = {"id": tid, "snapshot": domain, "instruction": instruction, "source": source,
                "config": config, "trajectory": f"solutions/{tid}.json", "related_apps": apps,
                "evaluator": evaluator, "proxy": False, "fixed_ip": False,
                "possibility_of_env_change": "low"}
        self.files[self.root / domain / f"{tid}.json"] = (json.dumps(task, indent=2) + "\n").encode()
        self.files[self.root / domain / "solutions" / f"{tid}.json"] = (json.dumps(steps, indent=1) + "\n").encode()
        self.index.setdefault(domain, []).append(tid)

    def infeasible(self, domain: str, tid: str, instruction: str) -> None:
        self.task(domain, tid, instruction, [], {"func": "infeasible"}, [["FAIL"]], [],
                  "osfarm-offline (infeasible)")

    def write(self) -> None:
        for p in sorted(self.cache.rglob("*")):
            if p.is_file() and zipfile.is_zipfile(p):
                _freeze_zip(p)
        for path, data in self.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        (self.root / "test_all.json").write_text(json.dumps(self.index, indent=2) + "\n")


# -- setup steps ---------------------------------------------------------------------------------

def dl(tid: str, name: str, dest: str) -> dict:
    return {"type": "download", "parameters": {"files": [{"url": URL.format(tid, name), "path": dest}]}}


def execute(shell_cmd: str) -> dict:
    return {"type": "execute", "parameters": {"command": shell_cmd, "shell": True}}


def launch(*argv: str) -> dict:
    return {"type": "launch", "parameters": {"command": list(argv)}}


def activate(window_name: str, by_class: bool = False) -> dict:
    p: dict[str, Any] = {"window_name": window_name}
    if by_class:
        p["by_class"] = True
    return {"type": "activate_window", "parameters": p}


def poll(cond: str, n: int = 50) -> str:
    """Shell prefix that waits up to n/10 s for cond (the evaluator's and setup's only waits)."""
    return f"for i in $(seq {n}); do {cond} && break; sleep 0.1; done; "


def wait_window(pattern: str, n: int = 150) -> dict:
    """Setup step: wait until a window whose title matches grep -i pattern is mapped."""
    return execute(poll(f"wmctrl -l | grep -qi -- {pattern!r}", n) + "true")


TERM = [launch("xfce4-terminal", "--disable-server"), activate("xfce4-terminal", by_class=True)]


def mark(tid: str) -> dict:
    """Setup step: a timestamp file the evaluator compares the result file's mtime with."""
    return execute(f"touch /tmp/.osfarm_t0_{tid}")


def saved_after_mark(tid: str, path: str, n: int = 60) -> dict:
    """Evaluator postconfig: wait until the app has written path after setup, then until its
    size and mtime hold still for 0.2 s (office apps write a file in several passes)."""
    return execute(poll(f"[ {path} -nt /tmp/.osfarm_t0_{tid} ]", n)
                   + f"s=; for i in $(seq 25); do n=$(stat -c %s.%y {path} 2>/dev/null); "
                   + '[ -n "$n" ] && [ "$n" = "$s" ] && break; s=$n; sleep 0.2; done')


def office_doc(tid: str, name: str, path: str | None = None) -> list[dict]:
    """Setup steps: put an office file in place, open it with its default app (LibreOffice)
    and wait until the document window is up and focused."""
    path = path or f"/home/user/{name}"
    folder, base = path.rsplit("/", 1)
    return [dl(tid, name, path), mark(tid),
            {"type": "open", "parameters": {"path": path}},
            # the lock file appears when loading starts; then wait until the document window is
            # painted and idle (osfarm-settle), or keys typed into it are lost
            execute(poll(f"[ -e '{folder}/.~lock.{base}#' ]", 200)
                    + f"osfarm-settle --window '{base} - LibreOffice' --process soffice.bin --timeout 60"),
            activate(base)]


def chrome(*urls: str) -> list[dict]:
    """Setup steps: start google-chrome (Chromium) with CDP reachable on 9222 as OSWorld does,
    and wait until its first tab has a title and the window is painted: before that the window
    is mapped but typing into it is lost."""
    return [launch("google-chrome", "--remote-debugging-port=1337", *urls),
            launch("socat", "tcp-listen:9222,fork", "tcp:localhost:1337"),
            execute(poll("wmctrl -l | grep -i -- ' - chromium$' | grep -qv Untitled", 300)
                    + "osfarm-settle --window ' - Chromium' --process chromium --timeout 60")]


# -- evaluator results ---------------------------------------------------------------------------

def cmdline(shell_cmd: str) -> dict:
    return {"type": "vm_command_line", "command": shell_cmd, "shell": True}


def vm_file(path: str) -> dict:
    return {"type": "vm_file", "path": path, "dest": Path(path).name}


def gold(tid: str, name: str) -> dict:
    return {"type": "cloud_file", "path": URL.format(tid, name), "dest": name}


def rule(**rules: Any) -> dict:
    return {"type": "rule", "rules": rules}


# -- reference-solution steps --------------------------------------------------------------------

# The reference solutions run on both desktops. Where a click's target sits elsewhere on the
# GNOME screen (the top bar, the dock, the Ubuntu font's metrics), the action chooses the point of
# the desktop it runs on, as someone looking at the screen would: Ubuntu's session says
# XDG_CURRENT_DESKTOP=ubuntu:GNOME, the light desktop GNOME.
ON_GNOME = "'ubuntu' in __import__('os').environ.get('XDG_CURRENT_DESKTOP', '').lower()"


def at(light: tuple[int, int], gnome: tuple[int, int]) -> str:
    """The arguments of a pyautogui call at a screen point: ``light`` on the light desktop,
    ``gnome`` on the GNOME one (``f"pyautogui.click({at(...)})"``)."""
    return f"*({gnome!r} if {ON_GNOME} else {light!r})"


def click_at(light: tuple[int, int], gnome: tuple[int, int]) -> list[str]:
    return [f"pyautogui.click({at(light, gnome)})"]


def typed(text: str) -> list[str]:
    """One step: type a line and press Enter."""
    return [f"pyautogui.write({text!r}, interval=0.01)", "pyautogui.press('enter')"]


def hotkey(*keys: str) -> list[str]:
    return [f"pyautogui.hotkey({', '.join(repr(k) for k in keys)})"]


def press(key: str, n: int = 1) -> list[str]:
    return [f"pyautogui.press({key!r}, presses={n})" if n > 1 else f"pyautogui.press({key!r})"]


def type_text(text: str) -> list[str]:
    return [f"pyautogui.write({text!r}, interval=0.01)"]


def wait_window_code(title: str, timeout_s: float = 20.0) -> str:
    """A solution step's code that waits until a window titled ``title`` is up, as an agent
    looking at the screen would before typing into a dialog that is slow to appear."""
    return ("import subprocess\n"
            f"for _ in range({int(timeout_s * 5)}):\n"
            f"    if {title!r} in subprocess.run(['wmctrl', '-l'], capture_output=True, text=True).stdout:\n"
            "        break\n"
            "    time.sleep(0.2)\n")


# Ctrl+S, then Enter = "Use <format> Format!" once LibreOffice's "Confirm File Format" dialog is up
SAVE_KEEP_FORMAT = [hotkey("ctrl", "s") + [wait_window_code("Confirm File Format")], press("enter")]
DONE = ["DONE"]


def await_window(pattern: str, present: bool = True, n: int = 100) -> list[str]:
    """One step: poll (up to n/10 s) until a window whose title matches grep -i pattern is
    mapped, or with present=False gone; an app maps a dialog a while after the key that asks."""
    cond = f"wmctrl -l | grep -qi -- {pattern!r}"
    if not present:
        cond = f"! {{ {cond}; }}"
    code = ("import subprocess\n"
            f"for _ in range({n}):\n"
            f"    if subprocess.run({cond!r}, shell=True).returncode == 0:\n"
            "        break\n"
            "    time.sleep(0.1)")
    return [code]


def pause(seconds: float = 0.4) -> list[str]:
    """A short pause inside a step: a menu posts its popup a moment after the key that opens
    it, and keys sent before that are lost."""
    return [f"time.sleep({seconds})"]


# Run by the system python3 of the desktop (it has PyGObject's Atspi): exit 0 as soon as a
# LibreOffice widget is named or reads argv[1] (its window's status bar "Slide 2 of 4", a view's
# "PresentationNotes" page object), 1 after argv[2] seconds.  Document contents are not walked.
_OFFICE_A11Y_WAIT = r'''
import sys, time
import gi
gi.require_version("Atspi", "2.0")
from gi.repository import Atspi
want, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
def shows(node, depth):
    try:
        role = node.get_role()
        if want in (node.get_name() or ""):
            return True
        if role == Atspi.Role.LABEL and want in (Atspi.Text.get_text(node, 0, -1) or ""):
            return True
        if depth > 10 or role in (Atspi.Role.MENU_BAR, Atspi.Role.TOOL_BAR):
            return False
        kids = [node.get_child_at_index(i) for i in range(min(node.get_child_count(), 60))]
        if role.value_nick.startswith("document"):
            return any(want in (k.get_name() or "") for k in kids)
        return any(shows(k, depth + 1) for k in kids)
    except Exception:
        return False
while time.monotonic() < deadline:
    desk = Atspi.get_desktop(0)
    apps = [desk.get_child_at_index(i) for i in range(desk.get_child_count())]
    if any(a is not None and a.get_name() == "soffice" and shows(a, 0) for a in apps):
        sys.exit(0)
    time.sleep(0.2)
sys.exit(1)
'''


def await_office(text: str, timeout_s: float = 30.0) -> list[str]:
    """One step: wait until LibreOffice shows ``text`` in its widgets (status bar, view objects),
    as read from its accessibility tree. LibreOffice runs shortcuts, menu items and Enter on a
    selected shape asynchronously, so a later click or typed key can overtake them; a step that
    needs their result (the next slide, the notes view) waits for it first."""
    return ["import subprocess\n"
            f"subprocess.run(['python3', '-c', {_OFFICE_A11Y_WAIT!r}, {text!r}, '{timeout_s:g}'], "
            f"timeout={timeout_s + 10:g})"]
