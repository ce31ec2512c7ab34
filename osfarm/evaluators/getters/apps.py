"""App getters (OSWorld ``getters/chrome.py``, ``vlc.py``, ``gimp.py``): read app state out of
the desktop through the guest controller.

Chromium's profile files are read where OSWorld looks (``~/.config/google-chrome/Default``),
then in Chromium's own folder (``~/.config/chromium/Default``). Tab getters talk to Chromium's
DevTools HTTP endpoint (port 9222) from a small stdlib script run *inside* the desktop, which
has its own network namespace; VLC's HTTP status is fetched the same way.

Not implemented (they need the internet or a Google account): ``googledrive_file``,
``info_from_website``, ``pdf_from_url``, ``gotoRecreationPage_and_get_html_content``.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

from osfarm.evaluators.getters.env import EvalEnv

log = logging.getLogger(__name__)

HOME = "/home/user"
CHROME_DIRS = (f"{HOME}/.config/google-chrome", f"{HOME}/.config/chromium")
DEVTOOLS_PORT = 9222
VLC_PORT = 8080
VLC_PASSWORD = "password"


# --- Chromium profile files ------------------------------------------------------------------


def _chrome_file(env: EvalEnv, *names: str) -> tuple[str, bytes] | None:
    """The first of ``<chrome dir>/<name>`` that exists: (desktop path, content)."""
    for base in CHROME_DIRS:
        for name in names:
            path = f"{base}/{name}"
            data = env.controller.get_file(path)
            if data is not None:
                return path, data
    return None


def _chrome_json(env: EvalEnv, name: str) -> Any:
    """Parsed JSON of a profile file; raises when it is missing or corrupt (callers default)."""
    found = _chrome_file(env, name)
    if found is None:
        raise FileNotFoundError(name)
    return json.loads(found[1])


def _prefs(env: EvalEnv) -> dict[str, Any]:
    return _chrome_json(env, "Default/Preferences")


def _sqlite_rows(env: EvalEnv, names: tuple[str, ...], dest: str, query: str) -> list[tuple] | None:
    """Copy a profile SQLite file (and its ``-wal`` journal, if the browser is running) into the
    cache dir, then run ``query`` on the copy."""
    found = _chrome_file(env, *names)
    if found is None:
        return None
    path, data = found
    local = env.cache_path(dest)
    local.write_bytes(data)
    wal = local.with_name(local.name + "-wal")
    wal_data = env.controller.get_file(path + "-wal")
    if wal_data:
        wal.write_bytes(wal_data)
    elif wal.exists():
        wal.unlink()
    try:
        with sqlite3.connect(local) as conn:
            return conn.execute(query).fetchall()
    except sqlite3.Error as e:
        log.warning("%s: %r", path, e)
        return None


def get_default_search_engine(env: EvalEnv, config: dict[str, Any]) -> str:
    guids = {
        "485bf7d3-0215-45af-87dc-538868000001": "Google",
        "485bf7d3-0215-45af-87dc-538868000003": "Bing",
        "485bf7d3-0215-45af-87dc-538868000002": "Yahoo!",
        "485bf7d3-0215-45af-87dc-538868000092": "DuckDuckGo",
    }
    try:
        data = _prefs(env)
        engine = guids.get(data.get("default_search_provider", {}).get("guid"))
        return engine or data.get("default_search_provider_data", {}).get("template_url_data", {}).get(
            "short_name", "Google")
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("default_search_engine: %r", e)
        return "Google"


def get_cookie_data(env: EvalEnv, config: dict[str, Any]) -> list[tuple] | None:
    """All rows of the ``cookies`` table (``dest`` names the local copy)."""
    return _sqlite_rows(env, ("Default/Cookies", "Default/Network/Cookies"), config.get("dest", "Cookies"),
                        "SELECT * FROM cookies")


def get_history(env: EvalEnv, config: dict[str, Any]) -> list[tuple] | None:
    """``(url, title, last_visit_time)`` of every row of ``urls`` in the History database."""
    return _sqlite_rows(env, ("Default/History",), config.get("dest", "History"),
                        "SELECT url, title, last_visit_time FROM urls")


def get_bookmarks(env: EvalEnv, config: dict[str, Any]) -> Any:
    """The ``roots`` of the Bookmarks file; ``[]`` when there is none."""
    found = _chrome_file(env, "Default/Bookmarks")
    if not found or not found[1]:
        return []
    try:
        return json.loads(found[1]).get("roots", {})
    except ValueError:
        return []


def _pref_flag(env: EvalEnv, pick: Any) -> str:
    try:
        return "true" if pick(_prefs(env)) else "false"
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("chrome preference: %r", e)
        return "false"


def get_enable_do_not_track(env: EvalEnv, config: dict[str, Any]) -> str:
    return _pref_flag(env, lambda d: d.get("enable_do_not_track", {}))


def get_enable_safe_browsing(env: EvalEnv, config: dict[str, Any]) -> str:
    return _pref_flag(env, lambda d: d.get("safebrowsing", {}).get("enabled", {}))


def get_enable_enhanced_safety_browsing(env: EvalEnv, config: dict[str, Any]) -> str:
    return _pref_flag(env, lambda d: d.get("safebrowsing", {}).get("enhanced", {}))


def get_new_startup_page(env: EvalEnv, config: dict[str, Any]) -> str:
    """"true" when Chrome opens the New Tab page at startup (no ``session`` key, or
    ``session.restore_on_startup == 5``)."""
    return _pref_flag(env, lambda d: "session" not in d or d["session"].get("restore_on_startup") == 5)


def get_chrome_font_size(env: EvalEnv, config: dict[str, Any]) -> dict[str, Any]:
    default = {"default_fixed_font_size": 13, "default_font_size": 16, "minimum_font_size": 13}
    try:
        return _prefs(env).get("webkit", {}).get("webprefs", default)
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("chrome_font_size: %r", e)
        return {"default_fixed_font_size": 13, "default_font_size": 16}


def get_profile_name(env: EvalEnv, config: dict[str, Any]) -> str | None:
    try:
        return _prefs(env).get("profile", {}).get("name")
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("profile_name: %r", e)
        return None


def get_chrome_language(env: EvalEnv, config: dict[str, Any]) -> str:
    try:
        return _chrome_json(env, "Local State").get("intl", {}).get("app_locale", "en-US")
    except Exception:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        return "en-US"


def get_enabled_experiments(env: EvalEnv, config: dict[str, Any]) -> list[str]:
    try:
        return _chrome_json(env, "Local State").get("browser", {}).get("enabled_labs_experiments", [])
    except Exception:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        return []


def _extension_settings(env: EvalEnv) -> dict[str, Any]:
    try:
        return _prefs(env).get("extensions", {}).get("settings", {})
    except Exception:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        return {}


def get_find_unpacked_extension_path(env: EvalEnv, config: dict[str, Any]) -> list[str]:
    """The ``path`` of every extension in the profile's extension settings."""
    return [s["path"] for s in _extension_settings(env).values() if isinstance(s, dict) and "path" in s]


def get_find_installed_extension_name(env: EvalEnv, config: dict[str, Any]) -> list[str]:
    """The manifest ``name`` of every extension in the profile's extension settings."""
    out = []
    for s in _extension_settings(env).values():
        name = s.get("manifest", {}).get("name") if isinstance(s, dict) else None
        if name is not None:
            out.append(name)
    return out


def get_shortcuts_on_desktop(env: EvalEnv, config: dict[str, Any]) -> dict[str, str]:
    """``{file name: content}`` of every ``.desktop`` file on ``~/Desktop``."""
    desktop = f"{HOME}/Desktop"
    tree = env.controller.get_directory_tree(desktop) or {}
    out: dict[str, str] = {}
    for child in tree.get("children", []):
        name = child.get("name", "")
        if name.endswith(".desktop"):
            data = env.controller.get_file(f"{desktop}/{name}")
            if data is not None:
                out[name] = data.decode("utf-8", "replace")
    return out


# --- Chromium DevTools (run inside the desktop) ------------------------------------------------

_DEVTOOLS_SCRIPT = r'''
import base64, json, os, socket, struct, sys, urllib.request
mode, port = sys.argv[1], int(sys.argv[2])

def pages():
    with urllib.request.urlopen("http://127.0.0.1:%d/json/list" % port, timeout=5) as r:
        return [t for t in json.load(r) if t.get("type") == "page"]

def evaluate(ws_url, expr):
    hostport, path = ws_url.split("://", 1)[1].split("/", 1)
    host, p = hostport.rsplit(":", 1)
    s = socket.create_connection((host, int(p)), timeout=15)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(("GET /%s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n" % (path, hostport, key)).encode())
        f = s.makefile("rb")
        if b" 101" not in f.readline():
            raise RuntimeError("websocket upgrade refused")
        while f.readline() not in (b"\r\n", b""):
            pass
        msg = json.dumps({"id": 1, "method": "Runtime.evaluate",
                          "params": {"expression": expr, "returnByValue": True}}).encode()
        n = len(msg)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                if n < 65536 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        s.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(msg)))
        buf = b""
        while True:
            b1, b2 = f.read(2)
            n = b2 & 0x7F
            if n == 126:
                n = struct.unpack(">H", f.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", f.read(8))[0]
            data = f.read(n)
            op = b1 & 0x0F
            if op == 8:
                raise RuntimeError("websocket closed")
            if op in (9, 10):
                continue
            buf += data
            if b1 & 0x80:
                reply = json.loads(buf)
                buf = b""
                if reply.get("id") == 1:
                    return reply.get("result", {}).get("result", {}).get("value")
    finally:
        s.close()

EXPR = ("JSON.stringify({visible: document.visibilityState === 'visible', title: document.title, "
        "url: location.href, content: (document.doctype ? new XMLSerializer().serializeToString("
        "document.doctype) : '') + document.documentElement.outerHTML})")

try:
    targets = pages()
except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
    print(json.dumps({"error": repr(e)}))
    sys.exit(0)
if mode == "tabs":
    print(json.dumps({"tabs": [{"title": t.get("title", ""), "url": t.get("url", "")} for t in targets]}))
else:
    first = None
    for t in targets:  # DevTools lists pages most recently active first
        if not t.get("webSocketDebuggerUrl"):
            continue
        try:
            info = json.loads(evaluate(t["webSocketDebuggerUrl"], EXPR))
        except Exception:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
            continue
        first = first or info
        if info.pop("visible"):
            print(json.dumps({"active": info}))
            break
    else:
        if first:
            first.pop("visible", None)
        print(json.dumps({"active": first}))
'''


def _devtools(env: EvalEnv, mode: str) -> dict[str, Any]:
    try:
        r = env.controller.execute(["python3", "-c", _DEVTOOLS_SCRIPT, mode, str(DEVTOOLS_PORT)], timeout=60)
        out = (r.get("output") or "").strip().splitlines()
        return json.loads(out[-1]) if out else {"error": r.get("error")}
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        return {"error": repr(e)}


def get_open_tabs_info(env: EvalEnv, config: dict[str, Any]) -> list[dict[str, str]]:
    """``[{title, url}]`` of every open tab; ``[]`` when no browser listens on port 9222."""
    r = _devtools(env, "tabs")
    if "tabs" not in r:
        log.info("open_tabs_info: %s", r.get("error"))
    return r.get("tabs", [])


def get_active_tab_info(env: EvalEnv, config: dict[str, Any]) -> dict[str, str] | None:
    """``{title, url, content}`` of the tab the user sees (its live DOM, not a reload);
    ``None`` when no browser listens on port 9222."""
    r = _devtools(env, "active")
    if r.get("active") is None:
        log.info("active_tab_info: %s", r.get("error", "no page"))
    return r.get("active")


# --- VLC, GIMP ---------------------------------------------------------------------------------


def _save(env: EvalEnv, data: bytes | None, dest: str) -> str | None:
    if data is None:
        return None
    p = env.cache_path(dest)
    p.write_bytes(data)
    return str(p)


def get_vlc_config(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """VLC's ``vlcrc`` saved as ``dest``; None when VLC never wrote one."""
    return _save(env, env.controller.get_file(f"{HOME}/.config/vlc/vlcrc"), config["dest"])


_VLC_SCRIPT = r'''
import base64, sys, urllib.request
req = urllib.request.Request("http://127.0.0.1:%s/requests/status.xml" % sys.argv[1])
req.add_header("Authorization", "Basic " + base64.b64encode((":" + sys.argv[2]).encode()).decode())
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        sys.stdout.write(r.read().decode("utf-8", "replace"))
except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
    sys.stderr.write(repr(e))
    sys.exit(1)
'''


def get_vlc_playing_info(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """VLC's HTTP interface ``status.xml`` (password ``password``) saved as ``dest``; None when
    VLC's HTTP interface does not answer."""
    try:
        r = env.controller.execute(["python3", "-c", _VLC_SCRIPT, str(VLC_PORT), VLC_PASSWORD], timeout=30)
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("vlc_playing_info: %r", e)
        return None
    if r.get("returncode") != 0 or not r.get("output"):
        log.info("vlc_playing_info: %s", r.get("error"))
        return None
    return _save(env, r["output"].encode(), config["dest"])


def get_gimp_config_file(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """GIMP's config file ``file_name`` (``~/.config/GIMP/2.10/``, else ``3.0/``) saved as
    ``dest``; None when missing."""
    for version in ("2.10", "3.0"):
        data = env.controller.get_file(f"{HOME}/.config/GIMP/{version}/{config['file_name']}")
        if data is not None:
            return _save(env, data, config["dest"])
    return None
