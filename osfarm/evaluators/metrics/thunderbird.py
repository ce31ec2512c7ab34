"""OSWorld's Thunderbird metrics (``metrics/thunderbird.py``): preferences (``prefs.js``),
message filters (``msgFilterRules.dat``) and mbox folders, read from the files the getters
fetched; the metric contract (``contract.py``) holds."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from osfarm.evaluators.metrics.contract import never_raises, read_text
from osfarm.evaluators.metrics.rules import match_record, match_value_to_rule

__all__ = ["METRICS"]

_PREF_LINE = re.compile(r'^user_pref\("(?P<key>(?:[^"]|\\")+)", (?P<val>.+)\);$')


@never_raises
def check_thunderbird_prefs(result: Any, rule: Mapping[str, Any]) -> float:
    """``prefs.js``: every ``rule["expect"][key]`` ``{method, ref}`` rule matches that pref's
    value (a missing pref fails) and no ``rule["unexpect"][key]`` rule matches. Values are
    parsed as JSON (``true``, ``42``, ``"text"``); the last occurrence of a key wins."""
    text = read_text(result)
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
            found[key] = match_value_to_rule(value, expect[key])
        elif key in unexpect and match_value_to_rule(value, unexpect[key]):
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


@never_raises
def check_thunderbird_filter(result: Any, rules: Mapping[str, Any]) -> float:
    """Message filters: each record in ``rules["expect"]`` (fields name, enabled, type, action,
    actionValue, condition = list of ``AND (field,op,value)`` strings) equals some filter on its
    given keys, and no filter matches a record of ``rules["unexpect"]``."""
    text = read_text(result)
    if text is None:
        return 0.0
    filters = _parse_filters(text)
    expect = rules.get("expect", [])
    unexpect = rules.get("unexpect", [])
    found = all(any(match_record(r, f) for f in filters) for r in expect)
    clean = not any(match_record(r, f) for r in unexpect for f in filters)
    return float(found and clean)


@never_raises
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
        text = read_text(path)
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

    for pred, gold in zip(result, reference, strict=True):
        mine, theirs = messages(pred), messages(gold)
        if mine is None or theirs is None or mine != theirs:
            return 0.0
    return 1.0


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f for f in (check_thunderbird_prefs, check_thunderbird_filter, check_thunderbird_folder)
}
