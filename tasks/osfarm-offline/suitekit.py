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

    # -- files under cache/<task_id>/ ----------------------------------------------------------

    def path(self, task_id: str, name: str) -> Path:
        """Where an asset lives; a module that builds a file itself (docx, pptx, png) saves here."""
        p = self.cache / task_id / name
        p.parent.mkdir(parents=True, exist_ok=True)
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


def saved_after_mark(tid: str, path: str, n: int = 150) -> dict:
    """Evaluator postconfig: wait until the app has written path after setup (then 1 s more,
    because office apps write the file in several passes)."""
    return execute(poll(f"[ {path} -nt /tmp/.osfarm_t0_{tid} ]", n) + "sleep 1")


def office_doc(tid: str, name: str, path: str | None = None) -> list[dict]:
    """Setup steps: put an office file in place, open it with its default app (LibreOffice)
    and wait until the document window is up and focused."""
    path = path or f"/home/user/{name}"
    folder, base = path.rsplit("/", 1)
    return [dl(tid, name, path), mark(tid),
            {"type": "open", "parameters": {"path": path}},
            execute(poll(f"[ -e '{folder}/.~lock.{base}#' ]", 200) + "sleep 0.5"),
            activate(base)]


def chrome(*urls: str) -> list[dict]:
    """Setup steps: start google-chrome (Chromium) with CDP reachable on 9222 as OSWorld does."""
    return [launch("google-chrome", "--remote-debugging-port=1337", *urls),
            launch("socat", "tcp-listen:9222,fork", "tcp:localhost:1337"),
            wait_window("chrom")]


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

def typed(text: str) -> list[str]:
    """One step: type a line and press Enter."""
    return [f"pyautogui.write({text!r}, interval=0.01)", "pyautogui.press('enter')"]


def hotkey(*keys: str) -> list[str]:
    return [f"pyautogui.hotkey({', '.join(repr(k) for k in keys)})"]


def press(key: str, n: int = 1) -> list[str]:
    return [f"pyautogui.press({key!r}, presses={n})" if n > 1 else f"pyautogui.press({key!r})"]


def type_text(text: str) -> list[str]:
    return [f"pyautogui.write({text!r}, interval=0.01)"]


SAVE_KEEP_FORMAT = [hotkey("ctrl", "s"), press("enter")]  # Enter = "Use <format>!" in LibreOffice
DONE = ["DONE"]
