"""OSWorld's Chrome metrics (``metrics/chrome.py``): the browser's state as the Chrome getters
hand it over (the active tab, open tabs, bookmarks, cookie and history rows, preferences, desktop
shortcuts, extensions) and web pages saved as HTML.

Names, signatures and scoring follow OSWorld so that task JSONs run unchanged. Each metric is a
pure function of a getter's value (a dict, a list of rows, a string, a file path) under the
metric contract (``contract.py``): a getter's None and malformed input score 0.0, an unknown
rule ``type`` raises :class:`~osfarm.evaluators.errors.RuleError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from itertools import product
from typing import Any
from urllib.parse import urlparse, urlunparse

from bs4 import BeautifulSoup, Tag

from osfarm.evaluators.metrics.contract import bad_input_scores_zero, is_file, never_raises
from osfarm.evaluators.metrics.rules import rule_type

__all__ = ["METRICS"]


# --------------------------------------------------------------------------- URLs (OSWorld's utils.py)


def _normalize_url(url: str) -> str:
    """OSWorld's ``compare_urls`` normal form: scheme defaults to http, scheme and host
    lower-cased, ``www.`` dropped, a bare ``/`` path dropped; query and fragment kept."""
    parsed = urlparse(url)
    scheme = (parsed.scheme or "http").lower()
    netloc = parsed.netloc.lower().replace("www.", "")
    path = parsed.path if parsed.path != "/" else ""
    return urlunparse(parsed._replace(scheme=scheme, netloc=netloc, path=path))


def _compare_urls(url1: Any, url2: Any) -> bool:
    """OSWorld's ``compare_urls``: equal after ``_normalize_url`` (None equals only None)."""
    if url1 is None or url2 is None:
        return url1 == url2
    return _normalize_url(str(url1)) == _normalize_url(str(url2))


def _are_lists_equal(list1: list[Any], list2: list[Any], same: Callable[[Any, Any], bool]) -> bool:
    """Same length and every item of ``list1`` has a ``same`` partner in ``list2`` (OSWorld)."""
    return len(list1) == len(list2) and all(any(same(a, b) for b in list2) for a in list1)


def _tab_url(active_tab_info: Any) -> Any:
    """A getter's active-tab value: either a dict with ``url`` or the URL string itself."""
    if isinstance(active_tab_info, Mapping):
        return active_tab_info.get("url")
    return active_tab_info


def _url_text(active_tab_info: Any) -> str | None:
    """The active tab's URL when the getter found a tab with a URL string, else None."""
    url = _tab_url(active_tab_info) if active_tab_info else None
    return url if isinstance(url, str) else None


# --------------------------------------------------------------------------- the browser's state


@never_raises
def is_expected_active_tab(active_tab_info: Any, rule: Mapping[str, Any]) -> float:
    """The active tab's URL equals ``rule["url"]`` up to ``compare_urls`` normalisation."""
    rule_type(rule, ("url",))
    if not active_tab_info:
        return 0.0
    actual = _tab_url(active_tab_info)
    if not actual:
        return 0.0
    return float(_compare_urls(rule["url"], actual))


@never_raises
def is_expected_active_tab_approximate(active_tab_info: Any, rule: Mapping[str, Any]) -> float:
    """Like :func:`is_expected_active_tab` but exact after dropping the query string."""
    rule_type(rule, ("url",))
    actual = _url_text(active_tab_info)
    if not actual:
        return 0.0

    def strip_query(url: str) -> str:
        return urlunparse(urlparse(url)._replace(query=""))

    return float(strip_query(rule["url"]) == strip_query(actual))


@never_raises
def is_expected_url_pattern_match(result: Any, rules: Mapping[str, Any]) -> float:
    """Every regex in ``rules["expected"]`` is found (``re.search``) in the URL."""
    url = _url_text(result)
    if url is None:
        return 0.0
    patterns = rules["expected"]
    if isinstance(patterns, str):
        patterns = [patterns]
    return float(all(re.search(p, url) for p in patterns))


@never_raises
def is_expected_search_query(active_tab_info: Any, rules: Mapping[str, Any]) -> float:
    """``rules["expect"]["pattern"]`` is found in the active tab's URL."""
    url = _url_text(active_tab_info)
    if url is None:
        return 0.0
    return float(re.search(rules["expect"]["pattern"], url) is not None)


@never_raises
def is_added_to_steam_cart(active_tab_info: Any, rule: Mapping[str, Any]) -> float:
    """Every name in ``rule["items"]`` appears in the page's HTML (``page_info`` of the cart)."""
    if not isinstance(active_tab_info, Mapping):
        return 0.0
    content = active_tab_info.get("content")
    if not isinstance(content, str):
        return 0.0
    return float(all(item in content for item in rule["items"]))


@never_raises
def is_expected_installed_extensions(installed_extensions: Any, expected: Mapping[str, Any]) -> float:
    """Every name in ``expected["expected"]`` is among the installed extensions."""
    if not installed_extensions or isinstance(installed_extensions, (str, bytes)):
        return 0.0
    return float(set(expected["expected"]).issubset(set(installed_extensions)))


@never_raises
def is_expected_tabs(open_tabs: Any, rule: Mapping[str, Any]) -> float:
    """The open tabs' URLs equal ``rule["urls"]`` as lists (same length, each expected URL
    matched by some open tab under ``compare_urls``)."""
    rule_type(rule, ("url",))
    if not open_tabs or not isinstance(open_tabs, list):
        return 0.0
    actual = [tab["url"] for tab in open_tabs]
    return float(_are_lists_equal(list(rule["urls"]), actual, _compare_urls))


def _bar_children(bookmarks: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(bookmarks["bookmark_bar"]["children"])


@never_raises
def is_expected_bookmarks(bookmarks: Any, rule: Mapping[str, Any]) -> float:
    """Chrome bookmark roots (``Bookmarks["roots"]``) against a rule.

    ``bookmark_bar_folders_names``: the set of folder names on the bar equals ``rule["names"]``.
    ``bookmark_bar_websites_urls``: the set of URLs on the bar equals ``rule["urls"]``.
    ``liked_authors_websites_urls``: a bar folder named one of ``rule["names"]`` (default
    "Liked Authors") whose URL set equals one choice per entry of ``rule["urls"]`` (an entry may
    be a list of alternatives).
    """
    kind = rule_type(
        rule, ("bookmark_bar_folders_names", "bookmark_bar_websites_urls", "liked_authors_websites_urls")
    )
    if not bookmarks or not isinstance(bookmarks, Mapping):
        return 0.0
    children = _bar_children(bookmarks)
    if kind == "bookmark_bar_folders_names":
        names = {b["name"] for b in children if b.get("type") == "folder"}
        return float(names == set(rule["names"]))
    if kind == "bookmark_bar_websites_urls":
        urls = {b["url"] for b in children if b.get("type") == "url"}
        return float(urls == set(rule["urls"]))
    allowed = rule.get("names", ["Liked Authors"])
    folder = next((b for b in children if b.get("type") == "folder" and b.get("name") in allowed), None)
    if folder is None:
        return 0.0
    liked = {b["url"] for b in folder.get("children", []) if b.get("type") == "url"}
    options = [[u] if isinstance(u, str) else list(u) for u in rule["urls"]]
    return float(any(set(combo) == liked for combo in product(*options)))


@never_raises
def is_cookie_deleted(cookie_data: Any, rule: Mapping[str, Any]) -> float:
    """No cookie row (``SELECT * FROM cookies``; column 1 is host_key) matches a domain in
    ``rule["domains"]`` under ``compare_urls``. No cookies at all counts as deleted."""
    rule_type(rule, ("domains",))
    if cookie_data is None:
        return 0.0
    hosts = [row[1] for row in cookie_data]
    return float(not any(_compare_urls(d, h) for d in rule["domains"] for h in hosts))


@never_raises
def check_history_deleted(history_data: Any, rule: Mapping[str, Any]) -> float:
    """No history row (column 0 is the URL) contains any of ``rule["keywords"]``. An empty
    history counts as deleted."""
    rule_type(rule, ("keywords",))
    if history_data is None:
        return 0.0
    urls = [str(row[0]) for row in history_data]
    return float(not any(k in u for k in rule["keywords"] for u in urls))


@never_raises
def is_shortcut_on_desktop(shortcuts: Any, rule: Mapping[str, Any]) -> float:
    """Some desktop entry (``{path: file text}``) has the line ``Name=<name>`` (type ``name``)
    or ``Exec=<exec>`` (type ``exec``)."""
    kind = rule_type(rule, ("name", "exec"))
    if not shortcuts or not isinstance(shortcuts, Mapping):
        return 0.0
    needle = f"Name={rule['name']}\n" if kind == "name" else f"Exec={rule['exec']}\n"
    return float(any(needle in str(content) for content in shortcuts.values()))


@never_raises
def check_font_size(font_size: Any, rule: Mapping[str, Any]) -> float:
    """``font_size["default_font_size"]`` equals ``rule["value"]`` (type ``value``) or lies
    strictly between ``rule["min"]`` and ``rule["max"]`` (type ``range``)."""
    kind = rule_type(rule, ("value", "range"))
    if not font_size or not isinstance(font_size, Mapping):
        return 0.0
    size = font_size["default_font_size"]
    if kind == "value":
        return float(size == rule["value"])
    return float(rule["min"] < size < rule["max"])


@never_raises
def check_enabled_experiments(enabled_experiments: Any, rule: Mapping[str, Any]) -> float:
    """The enabled chrome://flags names (``name@option`` stripped to ``name``) equal
    ``rule["names"]`` in order."""
    rule_type(rule, ("names",))
    if enabled_experiments is None or isinstance(enabled_experiments, (str, bytes)):
        return 0.0
    names = [str(e).split("@")[0] for e in enabled_experiments]
    return float(names == list(rule["names"]))


# --------------------------------------------------------------------------- web pages saved as HTML


@bad_input_scores_zero
def compare_htmls(html_path1: Any, html_path2: Any, **options: Any) -> float:
    """1 iff, walking both parsed documents in order, every paired node agrees: tags in name,
    stripped text and attributes, other nodes (text, comments) exactly."""
    if not is_file(html_path1) or not is_file(html_path2):
        return 0.0
    with open(html_path1, encoding="utf-8") as f:
        soup1 = BeautifulSoup(f, "lxml")
    with open(html_path2, encoding="utf-8") as f:
        soup2 = BeautifulSoup(f, "lxml")
    for e1, e2 in zip(soup1.descendants, soup2.descendants, strict=False):
        if isinstance(e1, Tag) and isinstance(e2, Tag):
            if e1.name != e2.name or e1.text.strip() != e2.text.strip() or e1.attrs != e2.attrs:
                return 0.0
        elif e1 != e2:
            return 0.0
    return 1.0


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f
    for f in (
        is_expected_active_tab, is_expected_active_tab_approximate, is_expected_url_pattern_match,
        is_expected_search_query, is_expected_installed_extensions, is_expected_tabs,
        is_added_to_steam_cart,
        is_expected_bookmarks, is_cookie_deleted, check_history_deleted, is_shortcut_on_desktop,
        check_font_size, check_enabled_experiments, compare_htmls,
    )
}
