"""Chrome getters (OSWorld ``getters/chrome.py``): read the browser's state out of the desktop.

Chromium's profile files are read where OSWorld looks (``~/.config/google-chrome/Default``),
then in Chromium's own folder (``~/.config/chromium/Default``). Tabs, pages and settings pages
are read through Chromium's DevTools from inside the desktop (``devtools.py``). The active tab's
URL comes from the address bar in the desktop's accessibility tree, as in OSWorld.

Not implemented (they need the internet or a Google account): ``googledrive_file``,
``info_from_website``, ``pdf_from_url``, ``gotoRecreationPage_and_get_html_content``.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import xml.etree.ElementTree as ET
from itertools import pairwise
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.getters.devtools import devtools
from osfarm.evaluators.getters.env import HOME, EvalEnv

log = logging.getLogger(__name__)

CHROME_DIRS = (f"{HOME}/.config/google-chrome", f"{HOME}/.config/chromium")


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
    local = None
    for base in CHROME_DIRS:  # streamed to disk with the byte cap: the agent can grow these files
        for name in names:
            path = f"{base}/{name}"
            local = env.fetch_vm_file(path, dest)
            if local is not None:
                break
        if local is not None:
            break
    if local is None:
        return None
    wal = env.fetch_vm_file(path + "-wal", dest + "-wal")
    if wal is not None and not wal.stat().st_size:
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


# --- open tabs (DevTools) ---------------------------------------------------------------------


def get_open_tabs_info(env: EvalEnv, config: dict[str, Any]) -> list[dict[str, str]]:
    """``[{title, url}]`` of every open tab; ``[]`` when no browser listens on port 9222."""
    r = devtools(env, "tabs")
    if "tabs" not in r:
        log.info("open_tabs_info: %s", r.get("error"))
    return r.get("tabs", [])


def get_active_tab_info(env: EvalEnv, config: dict[str, Any]) -> dict[str, str] | None:
    """``{title, url, content}`` of the tab the user sees (its live DOM, not a reload);
    ``None`` when no browser listens on port 9222."""
    r = devtools(env, "active")
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
        for k, v in zip((n.strip() for n in names.split(",")), (x.strip() for x in vals.split(",")), strict=False):
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
    r = devtools(env, "eval_url", url, expr)
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
    r = devtools(env, "open_eval", url, _PAGE_INFO_JS, "45", timeout=75)
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
    r = devtools(env, "open_eval", "chrome://settings/appearance", _APPEARANCE_JS, "15", timeout=45)
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
