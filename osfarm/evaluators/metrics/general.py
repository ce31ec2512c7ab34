"""OSWorld's general-purpose metrics (``metrics/general.py``): values against rules, text, JSON,
YAML, CSV and SQLite files, the accessibility tree.

Names, signatures and scoring follow OSWorld so that task JSONs run unchanged; the shared
contract (``contract.py``) holds: a getter's None, a missing file and malformed input (bad
JSON/YAML/CSV, a non-dict where a dict is expected) score 0.0, every score is a float in [0, 1],
and errors in the *task's own* configuration (an unknown ``literal_match`` type, an unknown rule
method) still raise.
"""

from __future__ import annotations

import csv
import datetime as _dt
import difflib
import json
import logging
import os
import re
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

import docx
import lxml.etree
import yaml
from lxml.cssselect import CSSSelector
from rapidfuzz import fuzz

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics.contract import read_text
from osfarm.evaluators.metrics.rules import match_record, match_value_to_rule

logger = logging.getLogger(__name__)

__all__ = ["METRICS"]


def _ratio(a: str, b: str) -> float:
    """rapidfuzz's ratio (0-100) scaled to [0, 1], as OSWorld uses it."""
    return fuzz.ratio(a, b) / 100.0


# --------------------------------------------------------------------------- value metrics


def exact_match(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``result == rules["expected"]``."""
    return float(result == rules["expected"])


def match_in_list(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``result`` is one of ``rules["expected"]`` (a list of accepted answers)."""
    try:
        return float(result in rules["expected"])
    except TypeError:
        return 0.0


def is_in_list(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff ``rules["expected"]`` is an element (or substring) of ``result``."""
    if result is None:
        return 0.0
    try:
        return float(rules["expected"] in result)
    except TypeError:
        return 0.0


def literal_match(result: Any, expected: Any, **options: Any) -> float:
    """Compare as strings (``type="str"``, default) or element-wise as string lists (``type="list"``).

    Options: ``type`` ("str" | "list"), ``ignore_case`` (bool).
    """
    literal_type = options.get("type", "str")
    fold: Callable[[Any], str] = (lambda s: str(s).lower()) if options.get("ignore_case", False) else str
    if literal_type == "str":
        return float(fold(result) == fold(expected))
    if literal_type == "list":
        if not isinstance(result, (list, tuple)) or not isinstance(expected, (list, tuple)):
            return 0.0
        if len(result) != len(expected):
            return 0.0
        return float([fold(s) for s in result] == [fold(s) for s in expected])
    raise UnsupportedOption(f"literal_match type {literal_type!r} not supported")


def check_include_exclude(result: Any, rules: Mapping[str, Any]) -> float:
    """1 iff every ``rules["include"]`` item is in ``result`` and no ``rules["exclude"]`` item is."""
    if result is None:
        return 0.0
    try:
        ok = all(r in result for r in rules.get("include", [])) and all(
            r not in result for r in rules.get("exclude", [])
        )
    except TypeError:
        return 0.0
    return float(ok)


def fuzzy_match(result: Any, rules: Mapping[str, Any]) -> float:
    """rapidfuzz ratio of ``result`` against ``rules["expected"]``, in [0, 1]."""
    if result is None:
        return 0.0
    return _ratio(str(result), str(rules["expected"]))


# OSWorld's marker, put in ``expected`` by a getter that could not compute the gold answer.
_EVALUATION_FAILED = "__EVALUATION_FAILED__"
# A control flag inside ``expected``, not a key of the result.
_IGNORE_LIST_ORDER = "ignore_list_order"


def check_direct_json_object(result: Any, rules: Mapping[str, Any]) -> float:
    """Compare a JSON object (a dict, or its text) key by key with ``rules["expected"]``.

    ``result`` may be a string: it is stripped, single quotes become double quotes (OSWorld's
    convention for Python-repr-like command output) and it is parsed as JSON.

    Default mode: every expected key must be equal in ``result`` (missing = None). With
    ``expected["ignore_list_order"]`` true, values are compared sorted. Upstream also compares the
    flag itself as a key, which always fails; here it is treated as the flag it is meant to be.

    ``rules["expect_in_result"]`` mode: an expected list passes if any element is in the
    result's list or equals the result's string; an expected string must be a substring of the
    result's value; other expected types fail.

    ``expected`` usually comes from the ``rule`` getter, or from ``rule_relativeTime``, which
    resolves relative dates into plain strings before this metric runs; a value equal to
    ``"__EVALUATION_FAILED__"`` (gold answer unavailable) scores 0.
    """
    if isinstance(result, str):
        try:
            result = json.loads(result.strip().replace("'", '"'))
        except json.JSONDecodeError:
            return 0.0
    if not isinstance(result, dict):
        return 0.0
    expected = rules.get("expected") or {}
    if not isinstance(expected, dict):
        return 0.0
    if any(v == _EVALUATION_FAILED for v in expected.values()):
        return 0.0

    if not rules.get("expect_in_result", False):
        ignore_order = bool(expected.get(_IGNORE_LIST_ORDER, False))
        for key, want in expected.items():
            if key == _IGNORE_LIST_ORDER:
                continue
            got = result.get(key)
            if ignore_order:
                try:
                    if got is None or sorted(want) != sorted(got):
                        return 0.0
                except TypeError:
                    return 0.0
            elif want != got:
                return 0.0
        return 1.0

    for key, want in expected.items():
        got = result.get(key)
        if isinstance(want, list):
            if isinstance(got, list):
                hit = any(w in got for w in want)
            elif isinstance(got, str):
                hit = any(w == got for w in want)
            else:
                hit = False
            if not hit:
                return 0.0
        elif isinstance(want, str):
            if not isinstance(got, str) or want not in got:
                return 0.0
        else:
            return 0.0
    return 1.0


# --------------------------------------------------------------------------- file metrics


def check_list(result: Any, rules: Mapping[str, Any]) -> float:
    """Line-wise regexes on a text file.

    Every ``rules["expect"]`` pattern must match (``re.search``) some line; no
    ``rules["unexpect"]`` pattern may match any line.
    """
    text = read_text(result)
    if text is None:
        return 0.0
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    # Lines keep their newline, as when iterating a file object upstream.
    lines = text.splitlines(keepends=True)
    found = all(any(p.search(line) for line in lines) for p in expect)
    clean = not any(p.search(line) for p in unexpect for line in lines)
    return float(found and clean)


def check_csv(result: Any, rules: Mapping[str, Any]) -> float:
    """Records of a CSV file (with header) against ``{"expect": [record], "unexpect": [record]}``.

    A record pattern matches a row when all its keys are present with equal (string) values.
    Every expected pattern must match some row; no unexpected pattern may match any row.
    """
    text = read_text(result)
    if text is None:
        return 0.0
    try:
        rows = list(csv.DictReader(text.splitlines()))
    except csv.Error:
        return 0.0
    expect = rules.get("expect", [])
    unexpect = rules.get("unexpect", [])
    found = all(any(match_record(p, row) for row in rows) for p in expect)
    clean = not any(match_record(p, row) for p in unexpect for row in rows)
    return float(found and clean)


def check_json(result: Any, rules: Mapping[str, Any], is_yaml: bool = False) -> float:
    """Values at key paths of a JSON (or YAML) file against ``{method, ref}`` rules.

    ``rules = {"expect": [{"key": [k1, k2, ...], "method": m, "ref": r}], "unexpect": [...]}``.
    An expected key path that does not exist scores 0; an unexpected one that does not exist
    is checked as the value None.
    """
    text = read_text(result)
    if text is None:
        return 0.0
    try:
        data = yaml.safe_load(text) if is_yaml else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError):
        return 0.0
    if data is None:
        return 0.0

    _missing = object()

    def walk(keys: list[Any]) -> Any:
        value = data
        for k in keys:
            try:
                value = value[k]
            except (KeyError, IndexError, TypeError):
                return _missing
        return value

    for rule in rules.get("expect", []):
        value = walk(rule["key"])
        if value is _missing or not match_value_to_rule(value, rule):
            return 0.0
    for rule in rules.get("unexpect", []):
        value = walk(rule["key"])
        if match_value_to_rule(None if value is _missing else value, rule):
            return 0.0
    return 1.0


# HH:MM:SS with a valid hour and minute (second 60 allowed for leap seconds), as upstream.
_TIME_RE = re.compile(r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)")


def check_line_number(file_path: Any, line_number: Mapping[str, Any]) -> float:
    """1 iff the number of lines that contain a HH:MM:SS time equals ``line_number["expected"]``."""
    text = read_text(file_path)
    if text is None:
        return 0.0
    count = sum(1 for line in text.splitlines() if _TIME_RE.search(line))
    try:
        return float(count == int(line_number["expected"]))
    except (TypeError, ValueError):
        return 0.0


def file_contains(file_path: Any, config: Mapping[str, Any]) -> float:
    """1 iff the file's text contains every string of ``config["expected"]``."""
    text = read_text(file_path)
    if text is None:
        return 0.0
    return float(all(s in text for s in config["expected"]))


def diff_text_file(result: Any, expect: Any) -> float:
    """Line-level similarity of two text files (difflib ratio), in [0, 1]."""
    got, want = read_text(result), read_text(expect)
    if got is None or want is None:
        return 0.0
    return difflib.SequenceMatcher(a=got.splitlines(), b=want.splitlines()).ratio()

def fuzzy_place_math(result_file_path: Any, rules: Mapping[str, Any]) -> float:
    """Words of a .docx against accepted answers: the document must hold exactly 3 words; the
    score is the mean over them of the best fuzzy ratio against ``rules["expected"]``."""
    if not result_file_path or not os.path.isfile(result_file_path):
        return 0.0
    try:
        document = docx.Document(result_file_path)
    except Exception:  # not a docx (zip/XML errors of several kinds)
        logger.debug("fuzzy_place_math: cannot open %s", result_file_path, exc_info=True)
        return 0.0
    words = [w for para in document.paragraphs for w in para.text.split()]
    if len(words) != 3:
        return 0.0
    answers = [str(a) for a in rules["expected"]]
    return sum(max((_ratio(w, a) for a in answers), default=0.0) for w in words) / 3


def compare_time_in_speedtest_results(
    speedtest_result_path: Any, time_diff: Any, *, now: _dt.datetime | None = None
) -> float:
    """1 iff the speedtest CSV's first data row was written less than ``time_diff`` minutes ago.

    The time is the last 5 characters (HH:MM) of the row's second column; only the clock time
    is compared, as upstream. ``now`` is ours, for tests; it defaults to the local time.
    """
    text = read_text(speedtest_result_path)
    if text is None:
        return 0.0
    lines = text.splitlines()
    try:
        stamp = lines[1].split(",")[1][-5:]
        then = _dt.datetime.strptime(stamp, "%H:%M")
        clock = (now or _dt.datetime.now()).strftime("%H:%M")
        minutes = abs((then - _dt.datetime.strptime(clock, "%H:%M")).total_seconds()) / 60
        return float(minutes < int(time_diff))
    except (IndexError, ValueError, TypeError):
        return 0.0


def _load_json_file(path: Any) -> Any:
    text = read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def is_included_all_json_objects(gold_file_path: Any, result_file_path: Any) -> float:
    """1 iff every top-level key/value of the gold JSON file is in the result JSON file."""
    gold, got = _load_json_file(gold_file_path), _load_json_file(result_file_path)
    if not isinstance(gold, dict) or not isinstance(got, dict):
        return 0.0
    return float(all(k in got and got[k] == v for k, v in gold.items()))


def compare_terminal_and_txt(txt_file_path: Any, terminal_output: Any) -> float:
    """1 iff the terminal output equals the text file's content exactly."""
    text = read_text(txt_file_path)
    if text is None or not terminal_output:
        return 0.0
    return float(terminal_output == text)


def _normalize_python(text: str) -> str:
    """Drop a leading shebang/coding header (first 3 lines) and blank lines, expand tabs to 4,
    strip trailing whitespace; anything else stays, so stray content is still caught."""
    lines = text.splitlines()
    i = 0
    while i < min(len(lines), 3):
        s = lines[i].strip()
        if s.startswith(("#!", "# -*- coding:", "# coding:", "# coding=")):
            i += 1
            continue
        break
    return "\n".join(line.expandtabs(4).rstrip() for line in lines[i:] if line.strip())


def compare_python_pure_text(py_file_path: Any, gold_file_path: Any) -> float:
    """1 iff two Python files are equal after light normalisation (see ``_normalize_python``)."""
    got, want = read_text(py_file_path), read_text(gold_file_path)
    if got is None or want is None:
        return 0.0
    return float(_normalize_python(got) == _normalize_python(want))


def run_sqlite3(result: Any, rules: Mapping[str, Any]) -> float:
    """Run ``rules["sql"]`` on the SQLite file ``result``; the score is the first column of the
    first row (NULL or no row = 0), clamped to [0, 1]."""
    if not result or not os.path.isfile(result):
        return 0.0
    try:
        # Read-only: a metric must never change the evidence it scores.
        with sqlite3.connect(f"file:{os.fspath(result)}?mode=ro", uri=True) as conn:
            row = conn.execute(rules["sql"]).fetchone()
    except sqlite3.Error:
        return 0.0
    try:
        value = float((row[0] if row else 0) or 0)
    except (TypeError, ValueError):
        return 0.0
    return min(max(value, 0.0), 1.0)


# OSWorld's namespace URIs of the accessibility-tree XML, per OS.
_A11Y_NS: dict[str, dict[str, str]] = {
    osname: {
        prefix: f"https://accessibility.{osname}.example.org/ns/{path}"
        for prefix, path in {
            "st": "state", "attr": "attributes", "cp": "component", "doc": "document",
            "docattr": "document/attributes", "txt": "text", "val": "value", "act": "action",
        }.items()
    }
    for osname in ("ubuntu", "windows", "macos")
}
_A11Y_NS["windows"]["class"] = "https://accessibility.windows.example.org/ns/class"
_A11Y_NS["macos"]["role"] = "https://accessibility.macos.example.org/ns/role"
del _A11Y_NS["macos"]["docattr"]


def check_accessibility_tree(result: Any, rules: list[Mapping[str, Any]], osname: str = "ubuntu") -> float:
    """Elements of the accessibility-tree XML selected by ``xpath`` (preferred) or CSS
    ``selectors`` (joined with ", "). Each rule with no element scores 0. With ``text``, the
    rule's score is the best over the elements of exact equality (``exact``, default True) or
    fuzzy ratio with the element's text; the total is the product over rules."""
    if not result:
        return 0.0
    ns = _A11Y_NS[osname]
    try:
        root = lxml.etree.fromstring(result.encode() if isinstance(result, str) else result)
    except lxml.etree.XMLSyntaxError:
        return 0.0
    total = 1.0
    for rule in rules:
        if "xpath" in rule:
            elements = root.xpath(rule["xpath"], namespaces=ns)
        elif "selectors" in rule:
            elements = CSSSelector(", ".join(rule["selectors"]), namespaces=ns)(root)
        else:
            raise ValueError("check_accessibility_tree: a rule needs xpath or selectors")
        if not elements:
            return 0.0
        if "text" in rule:
            want = rule["text"]
            exact = rule.get("exact", True)
            best = 0.0
            for el in elements:
                got = el.text or None
                if exact:
                    best = max(best, float(got == want))
                else:
                    best = max(best, _ratio(want, got or ""))
            total *= best
    return float(total)


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f
    for f in (
        exact_match, match_in_list, is_in_list, literal_match, check_include_exclude, fuzzy_match,
        check_direct_json_object, check_list, check_csv, check_json, check_line_number,
        file_contains, diff_text_file, fuzzy_place_math,
        compare_time_in_speedtest_results, is_included_all_json_objects, compare_terminal_and_txt,
        compare_python_pure_text, run_sqlite3, check_accessibility_tree,
    )
}
