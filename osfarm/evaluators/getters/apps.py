"""App getters (OSWorld ``getters/chrome.py``, ``vlc.py``, ``gimp.py``, ``vscode.py``,
``impress.py``): read app state out of the desktop through the guest controller.

Chromium's profile files are read where OSWorld looks (``~/.config/google-chrome/Default``),
then in Chromium's own folder (``~/.config/chromium/Default``). Tab getters talk to Chromium's
DevTools HTTP endpoint (port 9222) from a small stdlib script run *inside* the desktop, which
has its own network namespace; VLC's HTTP status is fetched the same way. Where OSWorld drives
Playwright (reading a tab's page, opening a page or the settings for the evaluation), the same
script evaluates JavaScript in the tab over DevTools. The active tab's URL comes from the
address bar in the desktop's accessibility tree, as in OSWorld.

Not implemented (they need the internet or a Google account): ``googledrive_file``,
``info_from_website``, ``pdf_from_url``, ``gotoRecreationPage_and_get_html_content``.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import sqlite3
import xml.etree.ElementTree as ET
import zipfile
from collections import Counter
from itertools import pairwise
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.getters import files as _files
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
import base64, json, os, socket, struct, sys, time, urllib.parse, urllib.request
mode, port = sys.argv[1], int(sys.argv[2])
args = sys.argv[3:]
BASE = "http://127.0.0.1:%d" % port

def pages():
    with urllib.request.urlopen(BASE + "/json/list", timeout=5) as r:
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
                          "params": {"expression": expr, "returnByValue": True, "awaitPromise": True}}).encode()
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

def norm(url):
    return urllib.parse.unquote(url or "").rstrip("/")

def visible(t):
    try:
        return evaluate(t["webSocketDebuggerUrl"], "document.visibilityState") == "visible"
    except Exception:  # noqa: BLE001 - a tab that does not answer is not the visible one
        return False

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
elif mode == "active":
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
elif mode == "eval_url":
    # args: url, expression. The tab showing url (the visible one if several do) evaluates it.
    want = norm(args[0])
    same = [t for t in targets if t.get("webSocketDebuggerUrl") and norm(t.get("url")) == want]
    if not same:
        print(json.dumps({"found": False, "urls": [t.get("url") for t in targets]}))
        sys.exit(0)
    tab = next((t for t in same if visible(t)), same[0])
    print(json.dumps({"found": True, "url": tab.get("url"), "value": evaluate(tab["webSocketDebuggerUrl"], args[1])}))
elif mode == "open_eval":
    # args: url, expression, seconds. Open url in a new tab of the running browser (its cookies
    # and settings), poll the expression until it gives a value, close the tab.
    req = urllib.request.Request(BASE + "/json/new?" + urllib.parse.quote(args[0], safe=""), method="PUT")
    with urllib.request.urlopen(req, timeout=15) as r:
        tab = json.load(r)
    value, deadline = None, time.monotonic() + float(args[2])
    try:
        while True:
            try:
                value = evaluate(tab["webSocketDebuggerUrl"], args[1])
            except Exception:  # noqa: BLE001 - the page is still navigating: ask again
                value = None
            if value is not None or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    finally:
        try:
            urllib.request.urlopen(BASE + "/json/close/" + tab["id"], timeout=5).close()
        except Exception:  # noqa: BLE001 - the tab may be gone already
            pass
    print(json.dumps({"value": value}))
'''


def _devtools(env: EvalEnv, mode: str, *args: str, timeout: float = 60) -> dict[str, Any]:
    try:
        r = env.controller.execute(["python3", "-c", _DEVTOOLS_SCRIPT, mode, str(DEVTOOLS_PORT), *args],
                                   timeout=timeout)
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


# --- the active tab's URL from the accessibility tree (OSWorld's active_url_from_accessTree) ----

_BROWSER_APPS = ("Google Chrome", "Chromium")
_ADDRESS_BAR = "Address and search bar"
# The omnibox hides "https://" (and "www."), so OSWorld re-adds a configured prefix; text that
# already names a scheme keeps it. Unlike OSWorld, "localhost:8000/x" is not taken for a scheme.
_HAS_SCHEME = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*://|(?:about|chrome|data|file|javascript|mailto|view-source):)")


def _is_focused(el: ET.Element) -> bool:
    return any(k.rsplit("}", 1)[-1] == "focused" and v == "true" for k, v in el.attrib.items())


def _address_bar_text(tree: str) -> str | None:
    """The text of the browser's address bar: the focused one if there are several windows,
    else the last one with text (OSWorld's choice)."""
    root = ET.fromstring(tree.encode("utf-8") if isinstance(tree, str) else tree)
    bars = [e for app in root.iter("application") if app.get("name") in _BROWSER_APPS
            for e in app.iter("entry") if e.get("name") == _ADDRESS_BAR and (e.text or "").strip()]
    if not bars:
        return None
    focused = [e for e in bars if _is_focused(e)]
    return ((focused or bars)[-1].text or "").strip()


def _with_prefix(text: str, goto_prefix: str) -> str:
    if _HAS_SCHEME.match(text):
        return text
    if goto_prefix.endswith("www.") and text.lower().startswith("www."):
        text = text[4:]
    return goto_prefix + text


def get_active_url_from_accessTree(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """The URL in the browser's address bar, read from the desktop's accessibility tree, with
    ``goto_prefix`` (default ``https://``) put in front of scheme-less text; None when no
    Chrome/Chromium window shows one."""
    try:
        tree = env.controller.get_accessibility_tree()
        text = _address_bar_text(tree) if tree else None
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("active_url_from_accessTree: %r", e)
        return None
    if not text:
        log.info("active_url_from_accessTree: no address bar with text")
        return None
    return _with_prefix(text, config.get("goto_prefix", "https://") or "")


def get_active_tab_url_parse(env: EvalEnv, config: dict[str, Any]) -> dict[str, Any] | None:
    """Query parameters ``parse_keys`` of the active URL (first value, "" when absent);
    ``replace`` renames keys ({old: new}), ``split_list`` splits every value on ","."""
    url = get_active_url_from_accessTree(env, config)
    if url is None:
        return None
    query = parse_qs(urlparse(url).query)
    out: dict[str, Any] = {k: query.get(k, [""])[0] for k in config["parse_keys"]}
    for old, new in (config.get("replace") or {}).items():
        out[new] = out.pop(old)
    if config.get("split_list", False):
        out = {k: v.split(",") for k, v in out.items()}
    return out


def get_url_dashPart(env: EvalEnv, config: dict[str, Any]) -> Any:
    """Part ``partIndex`` of the active URL split on "/" (negative counts from the end);
    ``needDeleteId`` drops a "?query"; ``returnType`` "string" or "json" (``{key: part}``)."""
    kind = config.get("returnType")
    if kind not in ("string", "json"):
        raise UnsupportedOption(f"url_dashPart: returnType {kind!r}")
    url = get_active_url_from_accessTree(env, config)
    if url is None:
        return None
    parts = url.split("/")
    try:
        part = parts[int(config["partIndex"])]
    except (IndexError, ValueError, TypeError):
        log.info("url_dashPart: no part %r in %s", config.get("partIndex"), url)
        return None
    if config.get("needDeleteId", False):
        part = part.split("?")[0]
    return part if kind == "string" else {config["key"]: part}


_DISCOUNT_50 = "50_PERCENT_ off & more"


def get_url_path_parse(env: EvalEnv, config: dict[str, Any]) -> dict[str, Any] | None:
    """Macy's product-listing URL (OSWorld's ``get_macys_product_url_parse``): ``mens_clothing``,
    ``shirts``, ``short_sleeve`` (True or None) from the path, and ``parse_keys`` from its
    "key1,key2/value1,value2" segments; ``Price_discount_range`` reads "50_PERCENT_ off & more"
    only when that is the sole discount filter among 20/30/50%, else "not_50_PERCENT_ off & more"."""
    url = get_active_url_from_accessTree(env, config)
    if url is None:
        return None
    path = unquote(urlparse(url).path)
    shirts, short_sleeve = "shirts" in path, "short-sleeve" in path
    values: dict[str, Any] = {}
    segments = path.strip("/").split("/")
    for names, vals in pairwise(segments):
        if "," not in names or "," not in vals:
            continue
        for k, v in zip((n.strip() for n in names.split(",")), (x.strip() for x in vals.split(","))):
            if k == "Price_discount_range":
                values[k] = [x.strip() for x in v.split("|")] if v else None
            else:
                values[k] = v or None
            shirts = shirts or (k == "Product_department" and v in ("shirts", "Shirts", "Shirt"))
            short_sleeve = short_sleeve or (k == "Sleeve_length" and v in ("short-sleeve", "Short Sleeve"))
        break
    values.setdefault("Men_regular_size_t", None)
    values.setdefault("Price_discount_range", None)
    out: dict[str, Any] = {
        "mens_clothing": True if "mens-clothing" in path else None,
        "shirts": True if shirts else None,
        "short_sleeve": True if short_sleeve else None,
    }
    for key in config["parse_keys"]:
        if key not in values:
            continue
        if key == "Price_discount_range":
            picked = values[key] or []
            only_50 = _DISCOUNT_50 in picked and not {"30_PERCENT_ off & more", "20_PERCENT_ off & more"} & set(picked)
            out[key] = _DISCOUNT_50 if only_50 else "not_" + _DISCOUNT_50
        else:
            out[key] = values[key]
    return out


# --- reading the active tab's page (OSWorld's active_tab_html_parse, with Playwright) ----------

_HTML_CATEGORIES = ("class", "label", "xpath", "input", "class&url")

# Runs in the page; ``cfg`` is the getter's config. Text is textContent, trimmed, as Playwright's
# text_content(); a missing element gives "" for its key.
_HTML_PARSE_JS = r"""
(cfg) => {
  const out = {};
  const trim = (s) => (s == null ? "" : String(s).trim());
  const all = (sel) => { try { return Array.from(document.querySelectorAll(sel)); } catch (e) { return []; } };
  const texts = (sel) => all(sel).map((el) => trim(el.textContent));
  const at = (list, k) => { const i = parseInt(k, 10); const j = i < 0 ? list.length + i : i;
                             return j >= 0 && j < list.length ? list[j] : ""; };
  const byXpath = (xp) => { try { return document.evaluate(xp, document, null,
      XPathResult.FIRST_ORDERED_NODE_TYPE, null).singleNodeValue; } catch (e) { return null; } };
  const squash = (s) => trim(s).replace(/\s+/g, " ").toLowerCase();
  // Playwright's text=... : the deepest elements whose text contains it (case-insensitive,
  // whitespace collapsed); button/submit inputs match on their value.
  const byText = (wanted) => {
    const w = squash(wanted);
    const skip = new Set(["HEAD", "SCRIPT", "STYLE", "NOSCRIPT", "TEMPLATE"]);
    const hit = (el) => !skip.has(el.tagName) && (squash(el.textContent).includes(w) ||
      (el.tagName === "INPUT" && ["button", "submit"].includes(el.type) && squash(el.value).includes(w)));
    let node = document.body && hit(document.body) ? document.body : null;
    if (!node) return null;
    for (;;) {
      const child = Array.from(node.children).find(hit);
      if (!child) return node;
      node = child;
    }
  };
  const cat = cfg.category;
  if (cat === "class") {
    for (const [name, keys] of Object.entries(cfg.class_multiObject || {})) {
      const ts = texts("." + name);
      for (const [k, key] of Object.entries(keys)) out[key] = at(ts, k);
    }
    for (const [name, keys] of Object.entries(cfg.class_multiObject_child || {})) {
      const first = all("." + name)[0];
      const ts = first ? Array.from(first.childNodes).filter((n) => n.nodeType === Node.TEXT_NODE)
        .map((n) => trim(n.textContent)).filter(Boolean) : [];
      for (const [k, key] of Object.entries(keys)) out[key] = at(ts, k);
    }
    for (const [name, keys] of Object.entries(cfg.class_multiObject_only_child || {})) {
      const ts = all("." + name).map((el) => el.querySelector("h3")).filter(Boolean).map((h) => trim(h.textContent));
      for (const [k, key] of Object.entries(keys)) out[key] = at(ts, k);
    }
    for (const [name, wanted] of Object.entries(cfg.class_multiObject_search_exist || {})) {
      const ts = texts("." + name);
      for (const w of wanted) if (w !== "is_other_exist") out[w] = ts.includes(w);
      if (wanted.includes("is_other_exist")) out.is_other_exist = ts.some((t) => !wanted.includes(t));
    }
    for (const [name, key] of Object.entries(cfg.class_singleObject || {})) {
      const ts = texts("." + name);
      out[key] = ts.length ? ts[0] : "";
    }
  } else if (cat === "label") {
    for (const [label, key] of Object.entries(cfg.labelObject || {})) {
      const el = byText(label);
      out[key] = el ? trim(el.textContent) : "";
    }
  } else if (cat === "xpath") {
    for (const [xp, key] of Object.entries(cfg.xpathObject || {})) {
      const el = byXpath(xp);
      out[key] = el ? trim(el.textContent) : "";
    }
  } else if (cat === "input") {
    for (const [xp, key] of Object.entries(cfg.inputObject || {})) {
      const el = byXpath(xp);
      out[key] = el && el.value != null ? trim(el.value) : "";
    }
  } else if (cat === "class&url") {
    const others = (ts, wanted) => ts.some((t) => wanted.every((w) => !w.toLowerCase().includes(t.toLowerCase())));
    const mark = (ts, wanted) => {
      for (const w of wanted) if (ts.some((t) => t.toLowerCase() === w.toLowerCase())) out[w.toLowerCase()] = true;
      if (others(ts, wanted)) out.is_other_exist = true;
      if (!("is_other_exist" in out)) out.is_other_exist = false;
    };
    for (const [name, wanted] of Object.entries(cfg.class_multiObject || {})) mark(texts("." + name), wanted);
    for (const [name, wanted] of Object.entries(cfg.class_multiObject_li || {})) {
      const ts = all("." + name + " li.catAllProducts").map((li) => li.querySelector("span"))
        .filter(Boolean).map((sp) => trim(sp.innerText));
      mark(ts, wanted);
    }
    const url = location.href.toLowerCase();
    for (const key of cfg.url_include_expected || []) {
      if (!(key.toLowerCase() in out)) out[key.toLowerCase()] = url.includes(key.toLowerCase());
    }
    for (const [key, value] of Object.entries(cfg.url_include_expected_multichoice || {})) {
      if (!(value.toLowerCase() in out)) out[value.toLowerCase()] = url.includes(key.toLowerCase());
    }
  }
  return out;
}
"""


def get_active_tab_html_parse(env: EvalEnv, config: dict[str, Any]) -> dict[str, Any] | None:
    """Texts picked out of the page shown at the active URL (from the accessibility tree), by
    ``category``: "class" (``class_singleObject``, ``class_multiObject``,
    ``class_multiObject_child``, ``class_multiObject_only_child``,
    ``class_multiObject_search_exist``), "label" (``labelObject``), "xpath" (``xpathObject``),
    "input" (``inputObject``: the field's value) or "class&url". None without an active URL,
    ``{}`` when no tab shows it (both score 0)."""
    category = config.get("category")
    if category not in _HTML_CATEGORIES:
        raise UnsupportedOption(f"active_tab_html_parse: category {category!r}")
    url = get_active_url_from_accessTree(env, config)
    if url is None:
        return None
    expr = f"({_HTML_PARSE_JS})({json.dumps(config)})"
    r = _devtools(env, "eval_url", url, expr)
    if not r.get("found"):
        log.info("active_tab_html_parse: no tab shows %s (%s)", url, r.get("error") or r.get("urls"))
        return {}
    value = r.get("value")
    return value if isinstance(value, dict) else {}


# --- pages opened for the evaluation (OSWorld opens them with Playwright) ------------------------

_PAGE_INFO_JS = ("document.readyState !== 'complete' ? null : {title: document.title, url: location.href, "
                 "content: (document.doctype ? new XMLSerializer().serializeToString(document.doctype) : '') "
                 "+ document.documentElement.outerHTML}")


def get_page_info(env: EvalEnv, config: dict[str, Any]) -> dict[str, str]:
    """``{title, url, content}`` of ``config["url"]`` opened in a new tab of the running browser
    (so with its cookies: a shop's cart shows what the agent added), once loaded; the tab is
    closed again. OSWorld's ``{"title": "Connection failed", ...}`` when that fails."""
    url = config["url"]
    r = _devtools(env, "open_eval", url, _PAGE_INFO_JS, "45", timeout=75)
    value = r.get("value")
    # A page that cannot load shows Chromium's error page, where Playwright's goto fails.
    if isinstance(value, dict) and not str(value.get("url", "")).startswith("chrome-error:"):
        return {"title": value.get("title", ""), "url": value.get("url", url), "content": value.get("content", "")}
    log.info("page_info %s: %s", url, r.get("error", "no page"))
    return {"title": "Connection failed", "url": url, "content": ""}


# The appearance page's "Mode" menu (Light / Dark / Device), found through the shadow roots of
# chrome://settings; its value is browser.theme.color_scheme2, which reaches the Preferences
# file only seconds later. null until the page has rendered it (the caller polls).
_APPEARANCE_JS = r"""
(() => {
  if (document.readyState !== "complete") return null;
  const modes = {"0": "system", "1": "light", "2": "dark"};
  const roots = [document];
  for (let i = 0; i < roots.length; i++) {
    const menu = roots[i].querySelector("#colorSchemeModeSelect");
    if (menu) return modes[String(menu.value)] || null;
    for (const el of roots[i].querySelectorAll("*")) if (el.shadowRoot) roots.push(el.shadowRoot);
  }
  return null;
})()
"""


def _color_scheme_from_prefs(env: EvalEnv) -> str:
    """OSWorld's ``get_chrome_color_scheme``: ``browser.theme.color_scheme2`` (else
    ``color_scheme``) 0/1/2 = system/light/dark; ``extensions.theme.system_theme`` 0 means light."""
    try:
        data = _prefs(env)
    except Exception as e:  # noqa: BLE001 - no profile yet: Chrome's default
        log.info("chrome color scheme: %r", e)
        return "system"
    theme = data.get("browser", {}).get("theme", {})
    raw = theme.get("color_scheme2", theme.get("color_scheme"))
    if data.get("extensions", {}).get("theme", {}).get("system_theme") in (0, "0", False):
        return "light"
    names = {0: "system", 1: "light", 2: "dark"}
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return names.get(int(raw), "system")
    if isinstance(raw, str) and raw.strip().lower() in ("system", "light", "dark"):
        return raw.strip().lower()
    return "system"


def get_chrome_appearance_mode_ui(env: EvalEnv, config: dict[str, Any]) -> str:
    """"light", "dark" or "system": the mode chrome://settings/appearance shows (opened in a
    new tab and closed again), else the one in the Preferences file."""
    r = _devtools(env, "open_eval", "chrome://settings/appearance", _APPEARANCE_JS, "15", timeout=45)
    if r.get("value") in ("light", "dark", "system"):
        return r["value"]
    log.info("chrome_appearance_mode_ui: settings page gave %r (%s); reading Preferences",
             r.get("value"), r.get("error", ""))
    return _color_scheme_from_prefs(env)


_SESSION_ONLY = 4  # Chrome's content-setting value "clear when all windows close"


def get_data_delete_automacally(env: EvalEnv, config: dict[str, Any]) -> str:
    """"true" when Chrome deletes site data on exit (the cookies default is "session only"),
    else "false". OSWorld only asks whether ``profile.default_content_setting_values`` exists,
    but Chromium writes that key into every new profile, so the setting itself is read."""
    try:
        values = _prefs(env)["profile"].get("default_content_setting_values") or {}
        return "true" if values.get("cookies") == _SESSION_ONLY else "false"
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("data_delete_automacally: %r", e)
        return "false"


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


# --- VLC as the default player, VS Code ----------------------------------------------------------

# OSWorld's list of video/* subtypes, in its order; it lists every one twice but x-ogm+ogg, so
# those count double when the most common default app is picked (it matters only for ties).
_VIDEO_SUBTYPES = (
    "3gp", "3gpp", "3gpp2", "avi", "divx", "dv", "fli", "flv", "mp2t", "mp4", "mp4v-es", "mpeg",
    "mpeg-system", "msvideo", "ogg", "quicktime", "vnd.divx", "vnd.mpegurl", "vnd.rn-realvideo", "webm",
    "x-anim", "x-avi", "x-flc", "x-fli", "x-flv", "x-m4v", "x-matroska", "x-mpeg", "x-mpeg-system",
    "x-mpeg2", "x-ms-asf", "x-ms-asf-plugin", "x-ms-asx", "x-ms-wm", "x-ms-wmv", "x-ms-wmx", "x-ms-wvx",
    "x-msvideo", "x-nsv", "x-ogm", "x-ogm+ogg", "x-theora", "x-theora+ogg",
)
_LISTED_ONCE = {"x-ogm+ogg"}

_XDG_MIME_SCRIPT = r'''
import json, subprocess, sys
out = {}
for t in sys.argv[1:]:
    r = subprocess.run(["xdg-mime", "query", "default", "video/" + t], capture_output=True, text=True)
    out[t] = r.stdout.strip()
print(json.dumps(out))
'''


def get_default_video_player(env: EvalEnv, config: dict[str, Any]) -> str:
    """The desktop file (e.g. ``vlc.desktop``) that ``xdg-mime`` opens most video types with;
    "unknown" when none has a default."""
    try:
        r = env.controller.execute(["python3", "-c", _XDG_MIME_SCRIPT, *_VIDEO_SUBTYPES], timeout=60)
        defaults = json.loads((r.get("output") or "").strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("default_video_player: %r", e)
        return "unknown"
    apps: list[str] = []
    for t in _VIDEO_SUBTYPES:
        app = defaults.get(t)
        if app:
            apps.extend([app] if t in _LISTED_ONCE else [app, app])
    return Counter(apps).most_common(1)[0][0] if apps else "unknown"


_VSCODE_KEYS_SCRIPT = r'''
import sys, time
import pyautogui
for kind, arg in [("hotkey", "ctrl+shift+p"), ("write", "Extensions: Enable All Extensions"), ("press", "enter"),
                  ("press", "enter"), ("hotkey", "ctrl+shift+p"), ("write", sys.argv[1]), ("press", "enter")]:
    if kind == "hotkey":
        pyautogui.hotkey(*arg.split("+"))
    elif kind == "write":
        pyautogui.write(arg)
    else:
        pyautogui.press(arg)
    time.sleep(0.5)  # the command palette opens and filters asynchronously
'''


def get_vscode_config(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """OSWorld's VS Code probe: in the focused VS Code window, enable all extensions, then run
    the command ``vscode_extension_command`` from the command palette (OSWorld's evaluation
    extension writes its answer to ``path``); ``path`` is saved as ``dest``. None when the
    file does not appear."""
    try:
        r = env.controller.execute(["python3", "-c", _VSCODE_KEYS_SCRIPT, config["vscode_extension_command"]],
                                   timeout=60)
        if r.get("returncode") != 0:
            log.info("vscode_config: the keys were not sent: %s", r.get("error"))
        env.controller.wait_for_file(config["path"], timeout=5)
    except Exception as e:  # noqa: BLE001 - the keys could not be sent: the file decides
        log.info("vscode_config: %r", e)
    return _files.get_vm_file(env, {"path": config["path"], "dest": config["dest"]})


# --- LibreOffice Impress: media of a slide (OSWorld's getters/impress.py) -----------------------

_RELS_NS = "{http://schemas.openxmlformats.org/package/2006/relationships}"
_P_NS = "{http://schemas.openxmlformats.org/presentationml/2006/main}"
_A_NS = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
_R_EMBED = "{http://schemas.openxmlformats.org/officeDocument/2006/relationships}embed"


def _deck(env: EvalEnv, config: dict[str, Any]) -> tuple[zipfile.ZipFile, int] | None:
    """The deck ``ppt_file_path`` fetched into the cache, open, and the slide number (1-based)."""
    ppt = config["ppt_file_path"]
    local = _files.get_vm_file(env, {"path": ppt, "dest": ppt.rstrip("/").rsplit("/", 1)[-1]})
    if not isinstance(local, str):
        return None
    try:
        return zipfile.ZipFile(local), int(config["slide_index"]) + 1
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        log.info("%s is not a deck: %r", ppt, e)
        return None


def _slide_media(env: EvalEnv, zf: zipfile.ZipFile, n: int, pick: Any, dest: str) -> str | None:
    """The target of the first relationship of slide ``n`` that ``pick(rel)`` accepts, saved as
    ``dest``: from inside the deck, or from the desktop when the slide links a file."""
    rels_name = f"ppt/slides/_rels/slide{n}.xml.rels"
    if rels_name not in zf.namelist():
        return None
    rel = next((r for r in ET.fromstring(zf.read(rels_name)).iter(f"{_RELS_NS}Relationship") if pick(r)), None)
    if rel is None:
        return None
    target = rel.get("Target", "")
    if rel.get("TargetMode") == "External" or target.startswith("file:"):
        path = unquote(urlparse(target).path) if target.startswith("file:") else target
        return _files.get_vm_file(env, {"path": path, "dest": dest})
    member = posixpath.normpath(posixpath.join("ppt/slides", target)) if not target.startswith("/") else target[1:]
    if member not in zf.namelist():
        return None
    return _save(env, zf.read(member), dest)


def get_audio_in_slide(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """The (first) audio of slide ``slide_index`` (0-based) of the deck ``ppt_file_path``,
    embedded or linked, saved as ``dest``; None when the slide has none."""
    deck = _deck(env, config)
    if deck is None:
        return None
    zf, n = deck
    with zf:
        return _slide_media(env, zf, n, lambda r: "audio" in r.get("Type", ""), config["dest"])


def get_background_image_in_slide(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """The picture filling the background of slide ``slide_index`` (0-based) of the deck
    ``ppt_file_path``, saved as ``dest``; None when the background is not a picture."""
    deck = _deck(env, config)
    if deck is None:
        return None
    zf, n = deck
    with zf:
        name = f"ppt/slides/slide{n}.xml"
        if name not in zf.namelist():
            return None
        bg = next(ET.fromstring(zf.read(name)).iter(f"{_P_NS}bgPr"), None)
        blip = next(bg.iter(f"{_A_NS}blip"), None) if bg is not None else None
        rid = blip.get(_R_EMBED) if blip is not None else None
        if not rid:
            return None
        return _slide_media(env, zf, n, lambda r: r.get("Id") == rid and "image" in r.get("Type", ""),
                            config["dest"])
