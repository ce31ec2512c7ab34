"""Run a task's ``config`` (and ``evaluator.postconfig``) steps against one desktop.

Every OSWorld setup type is implemented with OSWorld's parameters, without its fixed sleeps and
without re-sending steps that may already have run:

* ``open`` waits on the guest until the file's window is there (no sleep); ``activate_window``
  first waits (bounded) for a window with that title/class, because a preceding ``launch``
  returns before the app has mapped its window. In a postconfig (:data:`POSTCONFIG_WINDOW_S`)
  the apps are long up: a window that is not there is not waited for.
* ``execute``/``command`` with ``until`` re-run the command a bounded number of times
  (OSWorld loops forever when the condition is never met).
* ``chrome_open_tabs``/``chrome_close_tabs`` talk to Chromium's DevTools HTTP endpoints on
  ``localhost:9222`` from INSIDE the desktop (a stdlib python script run via ``execute``): the
  desktop has its own network namespace, so the host cannot reach that port.
* ``update_browse_history`` writes Chromium's ``History`` SQLite file in the profile inside the
  desktop. Chromium keeps that database open (exclusive lock, and it rewrites it from memory),
  so the step must run before Chromium starts or after it has been closed - which is how
  OSWorld's tasks order it (history first, then the ``launch`` of the browser). A locked
  database fails the step with a message saying so.
* ``googledrive`` and ``login`` need a Google account and raise :class:`SetupUnsupported`.
* A command (``execute``, ``command``, ``execute_with_verification``, ``launch``; config and
  postconfig alike) that installs packages or fetches URLs goes through
  :func:`osfarm.tasks.offline_steps.offline_command` first: the desktops have no network, so the
  step fails (naming what it needs) unless the desktop already has its packages, and then it runs
  without its network parts.

A failing step raises :class:`SetupFailed` with the step's index, type and reason; the runner
records that as an infrastructure error, not as the agent's failure. A path of the task that would
leave its folder (:mod:`osfarm.tasks.task_paths`: ``stdout``/``stderr`` names, ``file://`` or
local files outside the suite and the cache, symlinks) fails its step the same way, naming the
task file and JSON path, with the :class:`TaskPathError` as ``__cause__``.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osfarm.errors import InfraError
from osfarm.tasks.controller import GuestController, GuestError
from osfarm.tasks.filecache import AssetMissing, FileCache
from osfarm.tasks.model import ConfigStep
from osfarm.tasks.network_steps import Command
from osfarm.tasks.offline_steps import NeedsNetwork, offline_command
from osfarm.tasks.task_paths import TaskPathError, write_inside

DEFAULT_PROFILE = "/home/user/.config/google-chrome"
CDP_PORT = 9222


# activate_window's wait in an evaluator's postconfig: the task's apps started long before, and
# OSWorld's own step returns at once when no window matches (e.g. GIMP 2.10's image window is
# not titled "GNU Image Manipulation Program", which a GIMP postconfig names).
POSTCONFIG_WINDOW_S = 2.0

class SetupFailed(InfraError, RuntimeError):
    def __init__(self, index: int, type: str, reason: str):
        self.index, self.type, self.reason = index, type, reason
        super().__init__(f"setup step {index} ({type}) failed: {reason}")


class SetupUnsupported(SetupFailed):
    """The step cannot run in an offline farm (Google Drive, Google login)."""

    def __init__(self, index: int, type: str, reason: str):
        super().__init__(index, type, reason)
        self.args = (f"setup step {index} ({type}) is unsupported: {reason}",)

    def __str__(self) -> str:
        return self.args[0]


class _StepError(Exception):
    """Raised inside a step handler; run() turns it into SetupFailed with index and type."""


@dataclass
class StepReport:
    index: int
    type: str
    ok: bool
    seconds: float
    detail: str = ""


# ---------------------------------------------------------------- scripts run inside the desktop

_CDP_COMMON = r"""
import json, sys, time, urllib.parse, urllib.request
BASE = "http://localhost:__PORT__"
def call(path, method="GET"):
    req = urllib.request.Request(BASE + path, method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read().decode("utf-8", "replace")
    try:
        return json.loads(body)
    except ValueError:
        return body
def wait_up(timeout):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            return call("/json/version")
        except Exception as e:
            last = e
            time.sleep(0.2)
    print("Chromium DevTools not reachable on %s after %ss: %s" % (BASE, timeout, last), file=sys.stderr)
    sys.exit(3)
def norm(u):
    p = urllib.parse.urlsplit(u)
    return (p.scheme.lower(), p.netloc.lower(), p.path.rstrip("/"), p.query, p.fragment)
ARGS = json.loads(sys.argv[1])
""".replace("__PORT__", str(CDP_PORT))

CDP_OPEN = _CDP_COMMON + r"""
wait_up(ARGS["wait"])
for url in ARGS["urls"]:
    t = call("/json/new?" + urllib.parse.quote(url, safe=""), method="PUT")
    print(json.dumps({"opened": url, "id": t.get("id") if isinstance(t, dict) else None}))
"""

CDP_CLOSE = _CDP_COMMON + r"""
wait_up(ARGS["wait"])
targets = [t for t in call("/json/list") if t.get("type") == "page"]
for url in ARGS["urls"]:
    for t in targets:
        if norm(t.get("url", "")) == norm(url):
            call("/json/close/" + t["id"])
            print(json.dumps({"closed": url, "id": t["id"]}))
"""

HISTORY = r"""
import json, os, shutil, sqlite3, subprocess, sys, time
ARGS = json.loads(sys.argv[1])
path = os.path.expanduser(ARGS["path"])
profile = os.path.dirname(os.path.dirname(path))
os.makedirs(os.path.dirname(path), exist_ok=True)
def made_by_chromium(p):
    try:
        db = sqlite3.connect("file:%s?mode=ro" % p, uri=True, timeout=2)
        try:
            query = "SELECT count(*) FROM sqlite_master WHERE type='table' AND name='meta'"
            return db.execute(query).fetchone()[0] == 1
        finally:
            db.close()
    except sqlite3.Error:
        return False
# Chromium razes a History database it did not make (no 'meta' table with its schema version) and
# starts an empty one, so entries written into a file of our own vanish when it starts. Let this
# desktop's Chromium make the file first (headless, about:blank, ~2 s), unless it is running.
if not made_by_chromium(path) and not os.path.lexists(os.path.join(profile, "SingletonLock")):
    exe = next((e for e in ("chromium", "chromium-browser", "google-chrome") if shutil.which(e)), None)
    if exe is not None:
        for stale in (path, path + "-journal"):
            if os.path.exists(stale):
                os.unlink(stale)
        subprocess.run([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        "--user-data-dir=" + profile, "--dump-dom", "about:blank"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=90)
EPOCH_DELTA_US = 11644473600 * 1000000  # 1601-01-01 -> 1970-01-01, Chrome's time base
now_us = int(time.time() * 1000000) + EPOCH_DELTA_US
try:
    db = sqlite3.connect(path, timeout=2)
    db.execute("CREATE TABLE IF NOT EXISTS urls(id INTEGER PRIMARY KEY AUTOINCREMENT, url LONGVARCHAR, "
               "title LONGVARCHAR, visit_count INTEGER DEFAULT 0 NOT NULL, typed_count INTEGER DEFAULT 0 NOT NULL, "
               "last_visit_time INTEGER NOT NULL, hidden INTEGER DEFAULT 0 NOT NULL)")
    db.execute("CREATE TABLE IF NOT EXISTS visits(id INTEGER PRIMARY KEY AUTOINCREMENT, url INTEGER NOT NULL, "
               "visit_time INTEGER NOT NULL, from_visit INTEGER, transition INTEGER DEFAULT 0 NOT NULL, "
               "segment_id INTEGER, visit_duration INTEGER DEFAULT 0 NOT NULL)")
    for item in ARGS["history"]:
        t = now_us - int(float(item.get("visit_time_from_now_in_seconds", 0)) * 1000000)
        cur = db.execute("INSERT INTO urls (url, title, visit_count, typed_count, last_visit_time, hidden) "
                         "VALUES (?, ?, 1, 0, ?, 0)", (item["url"], item.get("title", ""), t))
        db.execute("INSERT INTO visits (url, visit_time, from_visit, transition, segment_id, visit_duration) "
                   "VALUES (?, ?, 0, 805306368, 0, 0)", (cur.lastrowid, t))
    db.commit()
    db.close()
except sqlite3.OperationalError as e:
    print("cannot write %s: %s (close Chromium first: it locks its History database)" % (path, e), file=sys.stderr)
    sys.exit(4)
print("added %d entries to %s" % (len(ARGS["history"]), path))
"""


def _python(script: str, args: dict[str, Any]) -> list[str]:
    return ["python3", "-c", script, json.dumps(args)]


# ---------------------------------------------------------------- executor


class SetupExecutor:
    """Runs setup steps in order; stops at the first failing one (SetupFailed)."""

    def __init__(self, controller: GuestController, cache: FileCache, task_id: str, screen: tuple[int, int],
                 client_password: str = "password", *, open_timeout: float = 120.0, window_timeout: float = 20.0,
                 until_tries: int = 30, until_interval: float = 0.3, cdp_wait: float = 30.0,
                 chrome_profile: str = DEFAULT_PROFILE, offline: bool | None = None,
                 output_dir: str | os.PathLike[str] | None = None):
        self.c = controller
        self.cache = cache
        self.task_id = task_id
        self.screen = screen
        self.client_password = client_password
        self.open_timeout = open_timeout
        self.window_timeout = window_timeout
        self.until_tries = until_tries
        self.until_interval = until_interval
        self.cdp_wait = cdp_wait
        self.chrome_profile = chrome_profile
        self.offline = offline
        # Where ``stdout``/``stderr`` of execute steps are saved. OSWorld saves them in the dir its
        # ``cache_file`` getters read (env.cache_dir), so an episode passes its getters' dir here.
        self.output_dir = output_dir
        self.handlers: dict[str, Callable[[dict[str, Any]], str]] = {
            "download": self._download,
            "launch": self._launch,
            "open": self._open,
            "execute": self._execute,
            "command": self._execute,
            "activate_window": self._activate_window,
            "close_window": self._close_window,
            "sleep": self._sleep,
            "chrome_open_tabs": self._chrome_open_tabs,
            "chrome_close_tabs": self._chrome_close_tabs,
            "update_browse_history": self._update_browse_history,
            "upload_file": self._upload_file,
            "change_wallpaper": self._change_wallpaper,
            "execute_with_verification": self._execute_with_verification,
            "googledrive": self._unsupported,
            "login": self._unsupported,
        }

    def run(self, steps: Sequence[ConfigStep | dict], where: str = "$.config") -> list[StepReport]:
        """Run ``steps``; ``where`` (``"<task file>: $.config"``) prefixes the JSON path in errors."""
        reports: list[StepReport] = []
        for i, step in enumerate(steps):
            typ: object  # a raw step's values are checked below
            params: object
            if isinstance(step, ConfigStep):
                typ, params = step.type, dict(step.parameters)
            elif isinstance(step, dict):
                typ, params = step.get("type"), step.get("parameters") or {}
            else:
                raise SetupFailed(i, "?", f"expected a {{type, parameters}} object, got {type(step).__name__}")
            if not isinstance(typ, str) or not isinstance(params, dict):
                raise SetupFailed(i, str(typ), "expected {type: str, parameters: object}")
            handler = self.handlers.get(typ)
            if handler is None:
                raise SetupFailed(i, typ, f"unknown setup type; known: {', '.join(sorted(SETUP_TYPES))}")
            t0 = time.monotonic()
            try:
                detail = handler(params)
            except SetupUnsupported as e:
                raise SetupUnsupported(i, typ, e.reason) from None
            except TaskPathError as e:
                raise SetupFailed(i, typ, f"{where}[{i}].parameters: {e}; refused") from e
            except NeedsNetwork as e:
                raise SetupFailed(i, typ, f"{where}[{i}]: {e}") from e
            except (_StepError, AssetMissing, GuestError) as e:
                raise SetupFailed(i, typ, str(e)) from e
            except (KeyError, TypeError, ValueError) as e:
                raise SetupFailed(i, typ, f"bad parameters {params!r}: {type(e).__name__}: {e}") from e
            reports.append(StepReport(i, typ, True, round(time.monotonic() - t0, 3), detail or ""))
        return reports

    # ------------------------------------------------------------ helpers

    def substitute(self, value: Any) -> Any:
        w, h = self.screen
        subs = {"{CLIENT_PASSWORD}": self.client_password, "{SCREEN_WIDTH}": str(w), "{SCREEN_HEIGHT}": str(h),
                "{SCREEN_WIDTH_HALF}": str(w // 2), "{SCREEN_HEIGHT_HALF}": str(h // 2)}
        if isinstance(value, str):
            for k, v in subs.items():
                value = value.replace(k, v)
            return value
        if isinstance(value, list):
            return [self.substitute(x) for x in value]
        return value

    def _outputs(self) -> Path:
        if self.output_dir is None:
            return self.cache.task_dir(self.task_id)
        out = Path(self.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        return out

    def _offline(self, command: Command, shell: bool) -> tuple[Command, str]:
        """The command without its network parts, and a note saying which were left out; raises
        NeedsNetwork when the desktop lacks what they would install."""
        command, needs = offline_command(self.c, command, shell)
        if not needs:
            return command, ""
        have = [*needs.apt, *(p.name for p in needs.pip)]
        return command, f"; offline, left out {', '.join(f'`{p}`' for p in needs.parts)}" + \
            (f" ({', '.join(have)} installed)" if have else "")

    def _run_checked(self, argv: list[str], what: str, timeout: float = 120.0) -> str:
        r = self.c.execute(argv, timeout=timeout)
        if r.get("status") != "success" or r.get("returncode") != 0:
            msg = (r.get("error") or r.get("message") or r.get("output") or "").strip()
            raise _StepError(f"{what}: exit {r.get('returncode')}: {msg[-1500:]}")
        return r.get("output", "")

    # ------------------------------------------------------------ handlers

    def _download(self, p: dict[str, Any]) -> str:
        files = p["files"]
        done = []
        for f in files:
            url, path = f["url"], f["path"]
            local = self.cache.fetch(url, self.task_id, name=os.path.basename(path), offline=self.offline)
            self.c.upload_file(path, local.read_bytes())
            done.append(path)
        return "uploaded " + ", ".join(done)

    def _upload_file(self, p: dict[str, Any]) -> str:
        done = []
        for f in p["files"]:
            local = self.cache.fetch(f["local_path"], self.task_id, name=os.path.basename(f["path"]),
                                     offline=self.offline)
            self.c.upload_file(f["path"], local.read_bytes())
            done.append(f["path"])
        return "uploaded " + ", ".join(done)

    def _launch(self, p: dict[str, Any]) -> str:
        shell = bool(p.get("shell", False))
        command, note = self._offline(p["command"], shell)
        self.c.launch(command, shell=shell)
        return f"launched {command if isinstance(command, str) else shlex.join(command)}{note}"

    def _open(self, p: dict[str, Any]) -> str:
        self.c.open_file(p["path"], timeout=self.open_timeout)
        return f"opened {p['path']}"

    def _execute(self, p: dict[str, Any]) -> str:
        shell = bool(p.get("shell", False))
        # read before the placeholders are filled in: errors and notes never show the password
        command, note = self._offline(p["command"], shell)
        command = self.substitute(command)
        until = p.get("until") or {}
        if not isinstance(until, dict):
            raise _StepError(f"until: expected an object, got {type(until).__name__}")
        tries = self.until_tries if until else 1
        result: dict[str, Any] = {}
        for attempt in range(1, tries + 1):
            result = self.c.execute(command, shell=shell)
            output, error = result.get("output") or "", result.get("error") or ""
            # OSWorld saves them as os.path.join(cache_dir, name); the name stays inside (no '..',
            # not absolute, no symlink on the way).
            if p.get("stdout"):
                write_inside(self._outputs(), p["stdout"], output.encode(), "stdout")
            if p.get("stderr"):
                write_inside(self._outputs(), p["stderr"], error.encode(), "stderr")
            if not until:
                break
            if ("returncode" in until and result.get("returncode") == until["returncode"]) or \
                    ("stdout" in until and str(until["stdout"]) in output) or \
                    ("stderr" in until and str(until["stderr"]) in error):
                return f"until {until} met after {attempt} tries{note}"
            if attempt < tries:
                time.sleep(self.until_interval)
        else:
            raise _StepError(f"until {until} not met after {tries} tries; last returncode "
                             f"{result.get('returncode')}, output {str(result.get('output'))[-300:]!r}")
        # Like OSWorld, a non-zero exit is not a setup failure (tasks run `pkill` & co.).
        return f"returncode {result.get('returncode')}" + (f" ({result['message']})" if result.get("message") else "") \
            + note

    def _execute_with_verification(self, p: dict[str, Any]) -> str:
        shell = bool(p.get("shell", False))
        # read before the placeholders are filled in: errors and notes never show the password
        command, note = self._offline(p["command"], shell)
        command = self.substitute(command)
        r = self.c.execute_with_verification(command, shell=shell,
                                             verification=p.get("verification") or {},
                                             max_wait_time=float(p.get("max_wait_time", 10)),
                                             check_interval=float(p.get("check_interval", 1)))
        if r.get("status") != "success":
            raise _StepError(f"verification {p.get('verification')!r} not passed: {r.get('status')} "
                             f"{r.get('message') or ''} after {r.get('wait_time')} s")
        return f"verification {r.get('verification', 'none')}{note}"

    def _activate_window(self, p: dict[str, Any]) -> str:
        name = p["window_name"]
        strict, by_class = bool(p.get("strict", False)), bool(p.get("by_class", False))
        # launch returns before the window maps: wait for it (bounded) instead of sleeping.
        if by_class:
            self.c.wait_for_window(wm_class=name, timeout=self.window_timeout)
        else:
            self.c.wait_for_window(title=name, timeout=self.window_timeout)
        if self.c.activate_window(name, strict=strict, by_class=by_class):
            return f"activated {name!r}"
        return f"no window {name!r} (ignored, as OSWorld does)"

    def _close_window(self, p: dict[str, Any]) -> str:
        name = p["window_name"]
        if self.c.close_window(name, strict=bool(p.get("strict", False)), by_class=bool(p.get("by_class", False))):
            return f"closed {name!r}"
        return f"no window {name!r} (ignored, as OSWorld does)"

    def _sleep(self, p: dict[str, Any]) -> str:
        seconds = float(p["seconds"])
        if not 0 <= seconds <= 3600:
            raise _StepError(f"seconds: must be in [0, 3600], got {seconds:g}")
        time.sleep(seconds)
        return f"slept {seconds:g} s"

    def _chrome_open_tabs(self, p: dict[str, Any]) -> str:
        urls = p["urls_to_open"]
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise _StepError("urls_to_open: expected a list of URLs")
        self._run_checked(_python(CDP_OPEN, {"urls": urls, "wait": self.cdp_wait}), "opening tabs",
                          timeout=self.cdp_wait + 60)
        return f"opened {len(urls)} tab(s)"

    def _chrome_close_tabs(self, p: dict[str, Any]) -> str:
        urls = p["urls_to_close"]
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise _StepError("urls_to_close: expected a list of URLs")
        out = self._run_checked(_python(CDP_CLOSE, {"urls": urls, "wait": self.cdp_wait}), "closing tabs",
                                timeout=self.cdp_wait + 60)
        return f"closed {out.count('closed')} tab(s)"

    def _update_browse_history(self, p: dict[str, Any]) -> str:
        history = p["history"]
        if not isinstance(history, list):
            raise _StepError("history: expected a list of {url, title, visit_time_from_now_in_seconds}")
        profile = p.get("profile_dir") or self.chrome_profile
        path = os.path.join(profile, "Default", "History")
        return self._run_checked(_python(HISTORY, {"path": path, "history": history}), "updating history").strip()

    def _change_wallpaper(self, p: dict[str, Any]) -> str:
        self.c.change_wallpaper(p["path"])
        return f"wallpaper {p['path']}"

    def _unsupported(self, p: dict[str, Any]) -> str:
        raise SetupUnsupported(-1, "?", "needs a Google account (Google Drive / Google login), which an offline "
                                        "farm does not have")


SETUP_TYPES: set[str] = {
    "download", "launch", "open", "execute", "command", "activate_window", "close_window", "sleep",
    "chrome_open_tabs", "chrome_close_tabs", "update_browse_history", "upload_file", "change_wallpaper",
    "execute_with_verification",
}
"""Setup types that run. ``UNSUPPORTED_TYPES`` are recognised but raise SetupUnsupported."""
UNSUPPORTED_TYPES: set[str] = {"googledrive", "login"}

__all__ = ["SETUP_TYPES", "UNSUPPORTED_TYPES", "SetupExecutor", "SetupFailed", "SetupUnsupported", "StepReport"]
