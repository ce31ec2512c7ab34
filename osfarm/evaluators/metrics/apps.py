"""OSWorld's application metrics: Chrome (``metrics/chrome.py``), VS Code (``vscode.py``),
GIMP's ``check_config_status``, Thunderbird (``thunderbird.py``) and a few ``docs.py`` leftovers.

Names, signatures and scoring follow OSWorld so that task JSONs run unchanged. Each metric is
a pure function over what OSWorld's getters hand over (a dict, a list of rows, a string, a
file path). As everywhere in osfarm:

* a getter that found nothing (``None``, an empty value, a path that does not exist) and any
  unreadable or malformed input score 0.0 instead of raising;
* every score is a float in [0, 1];
* errors in the *task's own* configuration (an unknown rule ``type``) still raise
  (:class:`RuleError`): they are bugs to fix, not agent failures.

``check_python_file_by_test_suite`` runs the task's test module in a child interpreter with a
timeout, never in the evaluator's own process.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Mapping
from itertools import product
from typing import Any
from urllib.parse import urlparse, urlunparse

from rapidfuzz import fuzz

from osfarm.evaluators.metrics.docs import compare_docx_files
from osfarm.evaluators.metrics.general import _match_record, _match_value_to_rule

logger = logging.getLogger(__name__)

__all__ = ["METRICS", "RuleError"]


class RuleError(ValueError):
    """The task's evaluator config is wrong (unknown rule type): raised, never scored."""


def _never_raises(fn: Callable[..., float]) -> Callable[..., float]:
    """Metric contract: odd input scores 0.0; only :class:`RuleError` propagates."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> float:
        try:
            score = float(fn(*args, **kwargs))
        except RuleError:
            raise
        except Exception as exc:  # noqa: BLE001 - metrics never raise; any failure scores 0.0
            logger.info("%s failed: %s", fn.__name__, exc)
            return 0.0
        return min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0

    return wrapper


def _is_file(path: Any) -> bool:
    return bool(path) and isinstance(path, (str, os.PathLike)) and os.path.isfile(path)


def _read_text(path: Any) -> str | None:
    if not _is_file(path):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


# --------------------------------------------------------------------------- URL helpers (utils.py)


def _normalize_url(url: str) -> str:
    """OSWorld's ``compare_urls`` normal form: scheme defaults to http, scheme and host
    lower-cased, ``www.`` dropped, a bare ``/`` path dropped; query and fragment kept."""
    parsed = urlparse(url)
    scheme = (parsed.scheme or "http").lower()
    netloc = parsed.netloc.lower().replace("www.", "")
    path = parsed.path if parsed.path != "/" else ""
    return urlunparse(parsed._replace(scheme=scheme, netloc=netloc, path=path))


def compare_urls(url1: Any, url2: Any) -> bool:
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


def _rule_type(rule: Mapping[str, Any], allowed: tuple[str, ...]) -> str:
    kind = rule.get("type")
    if kind not in allowed:
        raise RuleError(f"unsupported rule type {kind!r} (expected one of {allowed})")
    return kind  # type: ignore[return-value]


# --------------------------------------------------------------------------- Chrome


@_never_raises
def is_expected_active_tab(active_tab_info: Any, rule: Mapping[str, Any]) -> float:
    """The active tab's URL equals ``rule["url"]`` up to ``compare_urls`` normalisation."""
    _rule_type(rule, ("url",))
    if not active_tab_info:
        return 0.0
    actual = _tab_url(active_tab_info)
    if not actual:
        return 0.0
    return float(compare_urls(rule["url"], actual))


@_never_raises
def is_expected_active_tab_approximate(active_tab_info: Any, rule: Mapping[str, Any]) -> float:
    """Like :func:`is_expected_active_tab` but exact after dropping the query string."""
    _rule_type(rule, ("url",))
    if not active_tab_info:
        return 0.0
    actual = _tab_url(active_tab_info)
    if not isinstance(actual, str) or not actual:
        return 0.0

    def strip_query(url: str) -> str:
        return urlunparse(urlparse(url)._replace(query=""))

    return float(strip_query(rule["url"]) == strip_query(actual))


@_never_raises
def is_expected_url_pattern_match(result: Any, rules: Mapping[str, Any]) -> float:
    """Every regex in ``rules["expected"]`` is found (``re.search``) in the URL."""
    if not result:
        return 0.0
    url = _tab_url(result)
    if not isinstance(url, str):
        return 0.0
    patterns = rules["expected"]
    if isinstance(patterns, str):
        patterns = [patterns]
    return float(all(re.search(p, url) for p in patterns))


@_never_raises
def is_expected_search_query(active_tab_info: Any, rules: Mapping[str, Any]) -> float:
    """``rules["expect"]["pattern"]`` is found in the active tab's URL."""
    if not active_tab_info:
        return 0.0
    url = _tab_url(active_tab_info)
    if not isinstance(url, str):
        return 0.0
    return float(re.search(rules["expect"]["pattern"], url) is not None)


@_never_raises
def is_added_to_steam_cart(active_tab_info: Any, rule: Mapping[str, Any]) -> float:
    """Every name in ``rule["items"]`` appears in the page's HTML (``page_info`` of the cart)."""
    if not isinstance(active_tab_info, Mapping):
        return 0.0
    content = active_tab_info.get("content")
    if not isinstance(content, str):
        return 0.0
    return float(all(item in content for item in rule["items"]))


@_never_raises
def is_expected_installed_extensions(installed_extensions: Any, expected: Mapping[str, Any]) -> float:
    """Every name in ``expected["expected"]`` is among the installed extensions."""
    if not installed_extensions or isinstance(installed_extensions, (str, bytes)):
        return 0.0
    return float(set(expected["expected"]).issubset(set(installed_extensions)))


@_never_raises
def is_expected_tabs(open_tabs: Any, rule: Mapping[str, Any]) -> float:
    """The open tabs' URLs equal ``rule["urls"]`` as lists (same length, each expected URL
    matched by some open tab under ``compare_urls``)."""
    _rule_type(rule, ("url",))
    if not open_tabs or not isinstance(open_tabs, list):
        return 0.0
    actual = [tab["url"] for tab in open_tabs]
    return float(_are_lists_equal(list(rule["urls"]), actual, compare_urls))


def _bar_children(bookmarks: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(bookmarks["bookmark_bar"]["children"])


@_never_raises
def is_expected_bookmarks(bookmarks: Any, rule: Mapping[str, Any]) -> float:
    """Chrome bookmark roots (``Bookmarks["roots"]``) against a rule.

    ``bookmark_bar_folders_names``: the set of folder names on the bar equals ``rule["names"]``.
    ``bookmark_bar_websites_urls``: the set of URLs on the bar equals ``rule["urls"]``.
    ``liked_authors_websites_urls``: a bar folder named one of ``rule["names"]`` (default
    "Liked Authors") whose URL set equals one choice per entry of ``rule["urls"]`` (an entry may
    be a list of alternatives).
    """
    kind = _rule_type(
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


@_never_raises
def is_cookie_deleted(cookie_data: Any, rule: Mapping[str, Any]) -> float:
    """No cookie row (``SELECT * FROM cookies``; column 1 is host_key) matches a domain in
    ``rule["domains"]`` under ``compare_urls``. No cookies at all counts as deleted."""
    _rule_type(rule, ("domains",))
    if cookie_data is None:
        return 0.0
    hosts = [row[1] for row in cookie_data]
    return float(not any(compare_urls(d, h) for d in rule["domains"] for h in hosts))


@_never_raises
def check_history_deleted(history_data: Any, rule: Mapping[str, Any]) -> float:
    """No history row (column 0 is the URL) contains any of ``rule["keywords"]``. An empty
    history counts as deleted."""
    _rule_type(rule, ("keywords",))
    if history_data is None:
        return 0.0
    urls = [str(row[0]) for row in history_data]
    return float(not any(k in u for k in rule["keywords"] for u in urls))


@_never_raises
def is_shortcut_on_desktop(shortcuts: Any, rule: Mapping[str, Any]) -> float:
    """Some desktop entry (``{path: file text}``) has the line ``Name=<name>`` (type ``name``)
    or ``Exec=<exec>`` (type ``exec``)."""
    kind = _rule_type(rule, ("name", "exec"))
    if not shortcuts or not isinstance(shortcuts, Mapping):
        return 0.0
    needle = f"Name={rule['name']}\n" if kind == "name" else f"Exec={rule['exec']}\n"
    return float(any(needle in str(content) for content in shortcuts.values()))


@_never_raises
def check_font_size(font_size: Any, rule: Mapping[str, Any]) -> float:
    """``font_size["default_font_size"]`` equals ``rule["value"]`` (type ``value``) or lies
    strictly between ``rule["min"]`` and ``rule["max"]`` (type ``range``)."""
    kind = _rule_type(rule, ("value", "range"))
    if not font_size or not isinstance(font_size, Mapping):
        return 0.0
    size = font_size["default_font_size"]
    if kind == "value":
        return float(size == rule["value"])
    return float(rule["min"] < size < rule["max"])


@_never_raises
def check_enabled_experiments(enabled_experiments: Any, rule: Mapping[str, Any]) -> float:
    """The enabled chrome://flags names (``name@option`` stripped to ``name``) equal
    ``rule["names"]`` in order."""
    _rule_type(rule, ("names",))
    if enabled_experiments is None or isinstance(enabled_experiments, (str, bytes)):
        return 0.0
    names = [str(e).split("@")[0] for e in enabled_experiments]
    return float(names == list(rule["names"]))


# --------------------------------------------------------------------------- VS Code / config files


def _load_json(path: Any, skip_first_line: bool = False) -> Any:
    text = _read_text(path)
    if text is None:
        return None
    if skip_first_line:
        text = text.split("\n", 1)[1] if "\n" in text else ""
    try:
        return json.loads(text)
    except ValueError:
        return None


@_never_raises
def check_json_settings(actual: Any, expected: Mapping[str, Any], **options: Any) -> float:
    """Every key of ``expected["expected"]`` is in the JSON settings file with an equal value."""
    data = _load_json(actual)
    if not isinstance(data, dict):
        return 0.0
    want = expected["expected"]
    return float(all(k in data and data[k] == v for k, v in want.items()))


@_never_raises
def check_json_keybindings(actual: Any, expected: Mapping[str, Any], **options: Any) -> float:
    """The keybindings file (a JSON list; a first comment line is skipped if needed) contains
    ``expected["expected"]`` as one of its entries."""
    for skip in (False, True):
        data = _load_json(actual, skip_first_line=skip)
        if isinstance(data, list):
            break
    else:
        return 0.0
    return float(expected["expected"] in data)


@_never_raises
def compare_config(actual: Any, rules: Mapping[str, Any], **options: Any) -> float:
    """The file's whole text equals ``rules["expected"]``."""
    text = _read_text(actual)
    if text is None:
        return 0.0
    return float(text == rules["expected"])


@_never_raises
def compare_answer(actual: Any, rules: Mapping[str, Any], **options: Any) -> float:
    """The answer string equals ``rules["expected"]``."""
    if not actual:
        return 0.0
    return float(actual == rules["expected"])


@_never_raises
def is_extension_installed(actual: Any, rules: Mapping[str, Any], **options: Any) -> float:
    """``rules["expected"]`` is (type ``contain``) / is not (``not_contain``) in the extension
    listing (the output of ``code --list-extensions``). A missing listing scores 0."""
    kind = _rule_type(rules, ("contain", "not_contain"))
    if actual is None or not isinstance(actual, (str, list, tuple, set)):
        return 0.0
    present = rules["expected"] in actual
    return float(present if kind == "contain" else not present)


@_never_raises
def check_config_status(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
    """GIMP's s-expression config (gimprc, sessionrc...): some line ``(key ... value)`` has
    first token ``rule["key"]`` (or first two tokens, for a two-item key list) and last token
    ``rule["value"]``. Comment and blank lines are skipped."""
    key = rule["key"]
    if not (isinstance(key, str) or (isinstance(key, list) and len(key) == 2)):
        raise RuleError(f"check_config_status: key must be a string or a pair, got {key!r}")
    text = _read_text(actual_config_path)
    if text is None:
        return 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        items = line.strip().lstrip("(").rstrip(")").split()
        if not items:
            continue
        if isinstance(key, str):
            if items[0] == key and items[-1] == rule["value"]:
                return 1.0
        elif len(items) >= 2 and items[0] == key[0] and items[1] == key[1] and items[-1] == rule["value"]:
            return 1.0
    return 0.0


_RESULT_MARK = "@@OSFARM_TEST_RESULT@@"
_TEST_RUNNER = """
import importlib.util, os, sys
test_file, func_name = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(os.path.abspath(test_file)))
spec = importlib.util.spec_from_file_location("dynamic_module", test_file)
module = importlib.util.module_from_spec(spec)
sys.modules["dynamic_module"] = module
spec.loader.exec_module(module)
ok = getattr(module, func_name)()
sys.stdout.write("\\n@@OSFARM_TEST_RESULT@@" + ("1" if ok else "0") + "\\n")
"""


@_never_raises
def check_python_file_by_test_suite(actual_files: Any, test_file: Any, **options: Any) -> float:
    """Import ``test_file`` and call its ``options["test_function_name"]`` (default ``test``):
    1.0 iff it returns a truthy value.

    Unlike OSWorld, this runs in a child Python process (cwd = the test file's folder, which is
    also put on ``sys.path``), killed after ``options["timeout"]`` seconds (default 60). A crash,
    a missing function or a timeout scores 0.0. ``actual_files`` is not read: the test module
    locates the files it checks itself, as in OSWorld.
    """
    if not _is_file(test_file):
        return 0.0
    func_name = str(options.get("test_function_name", "test"))
    timeout = float(options.get("timeout", 60))
    test_path = os.path.abspath(os.fspath(test_file))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _TEST_RUNNER, test_path, func_name],
            check=False,
            cwd=os.path.dirname(test_path),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        logger.info("check_python_file_by_test_suite: %s timed out after %ss", test_path, timeout)
        return 0.0
    if proc.returncode != 0:
        logger.info("check_python_file_by_test_suite: %s failed: %s", test_path, proc.stderr[-2000:])
        return 0.0
    marks = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT_MARK)]
    return float(bool(marks) and marks[-1] == _RESULT_MARK + "1")


@_never_raises
def compare_result_files(src_path: Any, tgt_path: Any) -> float:
    """Two result files (stripped) agree: if the target is a number, the source contains the
    target's text or parses to a number within 1e-4 of it; otherwise the texts are equal."""
    src, tgt = _read_text(src_path), _read_text(tgt_path)
    if src is None or tgt is None:
        return 0.0
    src, tgt = src.strip(), tgt.strip()
    try:
        tgt_num = float(tgt)
    except ValueError:
        return float(src == tgt)
    if tgt in src:
        return 1.0
    try:
        return float(abs(float(src) - tgt_num) < 1e-4)
    except ValueError:
        return float(src == tgt)


# --------------------------------------------------------------------------- Thunderbird

_PREF_LINE = re.compile(r'^user_pref\("(?P<key>(?:[^"]|\\")+)", (?P<val>.+)\);$')


@_never_raises
def check_thunderbird_prefs(result: Any, rule: Mapping[str, Any]) -> float:
    """``prefs.js``: every ``rule["expect"][key]`` ``{method, ref}`` rule matches that pref's
    value (a missing pref fails) and no ``rule["unexpect"][key]`` rule matches. Values are
    parsed as JSON (``true``, ``42``, ``"text"``); the last occurrence of a key wins."""
    text = _read_text(result)
    if text is None:
        return 0.0
    expect: Mapping[str, Any] = rule.get("expect", {})
    unexpect: Mapping[str, Any] = rule.get("unexpect", {})
    found = {k: False for k in expect}
    clean = True
    for line in text.splitlines():
        m = _PREF_LINE.match(line.strip())
        if m is None:
            continue
        key = m.group("key")
        try:
            value = json.loads(m.group("val"))
        except ValueError:
            continue
        if key in expect:
            found[key] = _match_value_to_rule(value, expect[key])
        elif key in unexpect and _match_value_to_rule(value, unexpect[key]):
            clean = False
    return float(all(found.values()) and clean)


def _unescape_filter_value(value: str) -> str:
    return value.replace('\\"', '"').replace("\\\\", "\\")


_CONDITION = re.compile(r'\b(?:AND|OR) \((?:[\w ]+),(?:[\w \']+),(?:"(?:(?:[^"]|\")+)"|(?:[^)]+))\)|\bALL\b')
_FILTER_FIELDS = ("name", "enabled", "type", "action", "actionValue")


def _parse_filters(text: str) -> list[dict[str, Any]]:
    """``msgFilterRules.dat`` lines ``field="value"``; a filter ends with its ``condition=``."""
    filters: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    for line in text.splitlines():
        field, sep, raw = line.partition("=")
        if not sep or not (raw.startswith('"') and raw.endswith('"')) or len(raw) < 2:
            continue
        value = _unescape_filter_value(raw[1:-1])
        if field == "name":
            current = {"name": value}
        elif field in _FILTER_FIELDS:
            current[field] = value
        elif field == "condition":
            current["condition"] = _CONDITION.findall(value)
            filters.append(current)
    return filters


@_never_raises
def check_thunderbird_filter(result: Any, rules: Mapping[str, Any]) -> float:
    """Message filters: each record in ``rules["expect"]`` (fields name, enabled, type, action,
    actionValue, condition = list of ``AND (field,op,value)`` strings) equals some filter on its
    given keys, and no filter matches a record of ``rules["unexpect"]``."""
    text = _read_text(result)
    if text is None:
        return 0.0
    filters = _parse_filters(text)
    expect = rules.get("expect", [])
    unexpect = rules.get("unexpect", [])
    found = all(any(_match_record(r, f) for f in filters) for r in expect)
    clean = not any(_match_record(r, f) for r in unexpect for f in filters)
    return float(found and clean)


@_never_raises
def check_thunderbird_folder(result: Any, reference: Any, **kwargs: Any) -> float:
    """Thunderbird mbox folder file(s) hold the same messages as the reference(s).

    Messages are split on ``FROM - ``. Options: ignore_status (drop ``X-Mozilla-Status*``
    values), ignore_keys (drop the ``X-Mozilla-Keys`` line before ``MIME-Version``),
    remove_deleted (default True: skip status 0008/0009), remove_duplicate (default True).
    """
    if not isinstance(reference, list):
        result, reference = [result], [reference]
    if not isinstance(result, list) or len(result) != len(reference) or not reference:
        return 0.0

    def normalize(msg: str) -> str:
        if kwargs.get("ignore_status", False):
            msg = re.sub(r"X-Mozilla-Status\d?:[\s\d]+", "", msg)
        if kwargs.get("ignore_keys", False):
            msg = re.sub(r"(X-Mozilla-Keys:[^\n]*?)\n(MIME-Version)", r"\2", msg)
        return msg.strip()

    def messages(path: Any) -> str | None:
        text = _read_text(path)
        if text is None:
            return None
        out = []
        for mail in text.strip().split("FROM - "):
            if not mail.strip():
                continue
            if kwargs.get("remove_deleted", True) and re.search(r"X-Mozilla-Status: 000[89]", mail):
                continue
            out.append("FROM - " + normalize(mail))
        if kwargs.get("remove_duplicate", True):
            out = list(set(out))
        return "\n".join(sorted(out))

    for pred, gold in zip(result, reference):
        mine, theirs = messages(pred), messages(gold)
        if mine is None or theirs is None or mine != theirs:
            return 0.0
    return 1.0


# --------------------------------------------------------------------------- LibreOffice / docs.py leftovers

_OOR = "{http://openoffice.org/2001/registry}"


@_never_raises
def find_default_font(config_file_path: Any, rules: Mapping[str, Any]) -> float:
    """LibreOffice ``registrymodifications.xcu``: Writer's ``DefaultFont/Standard`` value equals
    ``rules["font_name"]`` (the last such item wins)."""
    expected = rules["font_name"]
    if not _is_file(config_file_path):
        return 0.0
    root = ET.parse(config_file_path).getroot()
    font = None
    for item in root.iter("item"):
        if item.get(f"{_OOR}path") != "/org.openoffice.Office.Writer/DefaultFont":
            continue
        for prop in item.iter("prop"):
            if prop.get(f"{_OOR}name") == "Standard":
                for value in prop.findall("value"):
                    font = value.text
    return float(font == expected)


def _docx(path: Any) -> Any:
    from docx import Document

    if not _is_file(path):
        return None
    return Document(path)


@_never_raises
def check_tabstops(docx_file1: Any, docx_file2: Any, **kwargs: Any) -> float:
    """Tab stops of the non-empty paragraphs match the reference: same count and alignment
    per paragraph, score 1 - mean(sum |position diff| / text width).

    ``word_number_split_by_tabstop=N`` (with ``index``, default 0) also requires the index-th
    tab-separated part of every paragraph to hold exactly N words."""
    from docx.enum.text import WD_TAB_ALIGNMENT

    doc1, doc2 = _docx(docx_file1), _docx(docx_file2)
    if doc1 is None or doc2 is None:
        return 0.0
    para1 = [p for p in doc1.paragraphs if p.text.strip()]
    para2 = [p for p in doc2.paragraphs if p.text.strip()]
    if len(para1) != len(para2) or not para1:
        return 0.0
    number = kwargs.get("word_number_split_by_tabstop")
    if number is not None:
        index = kwargs.get("index", 0)
        for p in para1:
            parts = p.text.split("\t")
            words = [w for w in re.split(r"\s", parts[index]) if w.strip()]
            if len(words) != number:
                return 0.0
    section = doc2.sections[0]
    width = section.page_width - section.left_margin - section.right_margin

    def kept(tab: Any) -> bool:
        return not (
            tab.alignment == WD_TAB_ALIGNMENT.CLEAR or (tab.alignment == WD_TAB_ALIGNMENT.LEFT and tab.position == 0)
        )

    minus = 0.0
    for p1, p2 in zip(para1, para2):
        tabs1 = [t for t in p1.paragraph_format.tab_stops if kept(t)]
        tabs2 = [t for t in p2.paragraph_format.tab_stops if kept(t)]
        if len(tabs1) != len(tabs2):
            return 0.0
        diff = 0.0
        for t1, t2 in zip(tabs1, tabs2):
            if t1.alignment != t2.alignment:
                return 0.0
            diff += abs(t1.position - t2.position)
        minus += diff / width
    return 1.0 - minus / len(para1)


@_never_raises
def compare_references(file1: Any, file2: Any, **options: Any) -> float:
    """Reference lists after the first paragraph equal to ``reference_indicator`` (default
    "References"): same count, mean fuzzy ratio r; score (r - base) / (1 - base) when
    r >= base + 0.01 (``reference_base_result``, default 0.5), else 0. No reference section in
    either document scores 1."""
    indicator = options.get("reference_indicator", "References")
    base = float(options.get("reference_base_result", 0.5))
    if not (isinstance(file1, str) and isinstance(file2, str)):
        return 0.0
    if not (file1.endswith(".docx") and file2.endswith(".docx")):
        return 0.0
    doc1, doc2 = _docx(file1), _docx(file2)
    if doc1 is None or doc2 is None:
        return 0.0
    paras1 = [p.text for p in doc1.paragraphs]
    paras2 = [p.text for p in doc2.paragraphs]
    idx1 = paras1.index(indicator) if indicator in paras1 else -1
    idx2 = paras2.index(indicator) if indicator in paras2 else -1
    if idx1 == -1 and idx2 == -1:
        return 1.0
    if idx1 == -1 or idx2 == -1:
        return 0.0
    refs1 = [p for p in paras1[idx1 + 1 :] if p.strip()]
    refs2 = [p for p in paras2[idx2 + 1 :] if p.strip()]
    if len(refs1) != len(refs2):
        return 0.0
    if not refs1:
        return 1.0
    mean = sum(fuzz.ratio(a, b) / 100.0 for a, b in zip(refs1, refs2)) / len(refs1)
    if mean >= base + 0.01:
        return (mean - base) / (1 - base)
    return 0.0


def _srgb_to_lab(rgb: Any) -> tuple[float, float, float]:
    """8-bit sRGB to CIE L*a*b* (D65, 2 degrees), as skimage's ``rgb2lab``."""

    def linear(c: float) -> float:
        c /= 255.0
        return ((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92

    r, g, b = (linear(float(c)) for c in rgb)
    x = (0.412453 * r + 0.357580 * g + 0.180423 * b) / 0.95047
    y = 0.212671 * r + 0.715160 * g + 0.072169 * b
    z = (0.019334 * r + 0.119193 * g + 0.950227 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def _delta_e_2000(lab1: tuple[float, float, float], lab2: tuple[float, float, float]) -> float:
    """CIEDE2000 colour difference (kL = kC = kH = 1)."""
    l1, a1, b1 = lab1
    l2, a2, b2 = lab2
    c_bar = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_bar**7 / (c_bar**7 + 25**7)))
    a1p, a2p = a1 * (1 + g), a2 * (1 + g)
    c1p, c2p = math.hypot(a1p, b1), math.hypot(a2p, b2)
    h1p = math.degrees(math.atan2(b1, a1p)) % 360 if c1p else 0.0
    h2p = math.degrees(math.atan2(b2, a2p)) % 360 if c2p else 0.0
    dl, dc = l2 - l1, c2p - c1p
    if c1p * c2p == 0:
        dh = 0.0
    elif abs(h2p - h1p) <= 180:
        dh = h2p - h1p
    elif h2p - h1p > 180:
        dh = h2p - h1p - 360
    else:
        dh = h2p - h1p + 360
    d_h = 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dh / 2))
    l_bar, cp_bar = (l1 + l2) / 2, (c1p + c2p) / 2
    if c1p * c2p == 0:
        h_bar = h1p + h2p
    elif abs(h1p - h2p) <= 180:
        h_bar = (h1p + h2p) / 2
    elif h1p + h2p < 360:
        h_bar = (h1p + h2p + 360) / 2
    else:
        h_bar = (h1p + h2p - 360) / 2
    t = (
        1
        - 0.17 * math.cos(math.radians(h_bar - 30))
        + 0.24 * math.cos(math.radians(2 * h_bar))
        + 0.32 * math.cos(math.radians(3 * h_bar + 6))
        - 0.20 * math.cos(math.radians(4 * h_bar - 63))
    )
    s_l = 1 + 0.015 * (l_bar - 50) ** 2 / math.sqrt(20 + (l_bar - 50) ** 2)
    s_c = 1 + 0.045 * cp_bar
    s_h = 1 + 0.015 * cp_bar * t
    d_theta = 30 * math.exp(-(((h_bar - 275) / 25) ** 2))
    r_c = 2 * math.sqrt(cp_bar**7 / (cp_bar**7 + 25**7))
    r_t = -math.sin(math.radians(2 * d_theta)) * r_c
    return math.sqrt(
        (dl / s_l) ** 2 + (dc / s_c) ** 2 + (d_h / s_h) ** 2 + r_t * (dc / s_c) * (d_h / s_h)
    )


@_never_raises
def evaluate_colored_words_in_tables(file_path1: Any, file_path2: Any, **kwargs: Any) -> float:
    """The result's text matches the reference (``compare_docx_files``) and, in every table,
    each run whose text starts with a vowel is red and every other run is blue: CIEDE2000
    distance to (255, 0, 0) / (0, 0, 255) at most ``threshold`` (default 3.5). A run without
    an explicit colour fails."""
    if not file_path1 or not file_path2:
        return 0.0
    if not compare_docx_files(file_path1, file_path2):
        return 0.0
    doc = _docx(file_path1)
    if doc is None:
        return 0.0
    threshold = float(kwargs.get("threshold", 3.5))
    red, blue = _srgb_to_lab((255, 0, 0)), _srgb_to_lab((0, 0, 255))
    for table in doc.tables:
        for row in table.rows:
            for cell in row.cells:
                for paragraph in cell.paragraphs:
                    for run in paragraph.runs:
                        if not run.text:
                            continue
                        rgb = run.font.color.rgb
                        if rgb is None:
                            return 0.0
                        target = red if run.text[0].lower() in "aeiou" else blue
                        if _delta_e_2000(_srgb_to_lab(tuple(rgb)), target) > threshold:
                            return 0.0
    return 1.0


_ODF_STYLE = "urn:oasis:names:tc:opendocument:xmlns:style:1.0"
_ODF_FO = "urn:oasis:names:tc:opendocument:xmlns:xsl-fo-compatible:1.0"
_ODF_OFFICE = "urn:oasis:names:tc:opendocument:xmlns:office:1.0"
_ODF_TEXT = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"


@_never_raises
def check_highlighted_words(file_path1: Any, file_path2: Any) -> float:
    """The .odt result matches the reference text (``compare_docx_files``) and no text span
    uses an automatic style with yellow (``#ffff00``) background: the highlights were removed."""
    if not file_path1 or not file_path2:
        return 0.0
    if not compare_docx_files(file_path1, file_path2):
        return 0.0
    with zipfile.ZipFile(file_path1) as zf:
        root = ET.fromstring(zf.read("content.xml"))
    yellow: set[str] = set()
    auto = root.find(f"{{{_ODF_OFFICE}}}automatic-styles")
    if auto is not None:
        for style in auto:
            for prop in style:
                if (prop.get(f"{{{_ODF_FO}}}background-color") or "").lower() == "#ffff00":
                    yellow.add(style.get(f"{{{_ODF_STYLE}}}name", ""))
    for span in root.iter(f"{{{_ODF_TEXT}}}span"):
        if span.get(f"{{{_ODF_TEXT}}}style-name") in yellow:
            return 0.0
    return 1.0


def _train_lines(path: Any) -> tuple[list[str], list[str]] | None:
    doc = _docx(path)
    if doc is None:
        return None
    lines = [p.text.strip() for p in doc.paragraphs if p.text.strip()]
    ids = [line.split(",")[1].strip() for line in lines if len(line.split(",")) == 4]
    return lines, ids


@_never_raises
def compare_unique_train_records(processed_file: Any, expected_files: Any, **kwargs: Any) -> float:
    """De-duplicated train records (``time, train_id, station, platform`` lines of a .docx).

    ``expected_files = [gold, initial]``. 1 iff every processed line was in the initial file,
    no train id repeats, the set of ids equals the gold one and the line counts agree."""
    if not processed_file or not isinstance(expected_files, list) or len(expected_files) < 2:
        return 0.0
    processed, gold, initial = (_train_lines(p) for p in (processed_file, expected_files[0], expected_files[1]))
    if processed is None or gold is None or initial is None:
        return 0.0
    p_lines, p_ids = processed
    g_lines, g_ids = gold
    if not set(p_lines) <= set(initial[0]):
        return 0.0
    if len(p_ids) != len(set(p_ids)):
        return 0.0
    if set(p_ids) != set(g_ids):
        return 0.0
    return float(len(p_lines) == len(g_lines))


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f
    for f in (
        # chrome.py
        is_expected_active_tab, is_expected_active_tab_approximate, is_expected_url_pattern_match,
        is_expected_search_query, is_expected_installed_extensions, is_expected_tabs,
        is_added_to_steam_cart,
        is_expected_bookmarks, is_cookie_deleted, check_history_deleted, is_shortcut_on_desktop,
        check_font_size, check_enabled_experiments,
        # vscode.py, gimp.py
        check_json_settings, check_json_keybindings, compare_config, compare_answer,
        is_extension_installed, check_config_status, check_python_file_by_test_suite,
        compare_result_files,
        # thunderbird.py
        check_thunderbird_prefs, check_thunderbird_filter, check_thunderbird_folder,
        # docs.py
        find_default_font, check_tabstops, compare_references, check_highlighted_words,
        evaluate_colored_words_in_tables, compare_unique_train_records,
    )
}
