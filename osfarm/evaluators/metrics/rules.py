"""OSWorld's ``{"method", "ref"}`` rule language (its ``metrics/utils.py``), shared by the
metrics that check values against rules (JSON keys, Thunderbird prefs, ID3 tags, spreadsheet
cells); record patterns (``{field: value}`` matched against a row or a filter); and the check
of a rule's ``type``."""

from __future__ import annotations

import builtins
import operator
import re
from collections.abc import Mapping
from typing import Any

from osfarm.evaluators.errors import RuleError, UnsupportedOption

__all__ = ["match_record", "match_value_to_rule", "rule_type"]


def _compare(op_name: str, a: Any, b: Any) -> bool:
    """An ``operator`` comparison that is False, not an error, for incomparable types (None)."""
    try:
        return bool(getattr(operator, op_name)(a, b))
    except TypeError:
        return False


def match_value_to_rule(value: Any, rule: Mapping[str, Any]) -> bool:
    """Whether ``value`` satisfies ``rule``.

    Methods: ``re[.FLAG...]`` (regex search, flags by ``re`` attribute name), ``eq ne le lt ge
    gt``, ``approx:THRESHOLD`` (|float(value) - ref| <= threshold), ``range.XY`` with X, Y in
    {t, e} (``ref[0] <X value <Y ref[1]``, t = strict), ``str_list_eq`` / ``str_set_eq`` (the
    value as a comma-separated string, surrounding quotes stripped, against a list). An unknown
    method raises :class:`UnsupportedOption`.
    """
    method: str = rule["method"]
    ref: Any = rule.get("ref")  # its type depends on the method: a pattern, a number, a pair, a list
    if method.startswith("re"):
        flags = re.RegexFlag(0)
        for name in method.split(".")[1:]:
            flags |= getattr(re, name)
        # A missing value (None) matches no pattern: it is absent, not the text "None".
        return value is not None and re.search(ref, str(value), flags) is not None
    if method in {"eq", "ne", "le", "lt", "ge", "gt"}:
        return _compare(method, value, ref)
    if method.startswith("approx"):
        threshold = float(method.split(":")[1])
        try:
            return abs(float(value) - float(ref)) <= threshold
        except (TypeError, ValueError):
            return False
    if method.startswith("range."):
        left, right = method[6], method[7]
        return _compare("l" + left, ref[0], value) and _compare("l" + right, value, ref[1])
    if method in {"str_list_eq", "str_set_eq"}:
        container = getattr(builtins, method[4:-3])  # list or set
        return container(str(value).strip("\"'").split(",")) == container(ref)
    raise UnsupportedOption(f"unknown rule method {method!r}")


def match_record(pattern: Mapping[str, Any], record: Mapping[str, Any]) -> bool:
    """Every key of ``pattern`` is in ``record`` with an equal value."""
    return all(k in record and record[k] == v for k, v in pattern.items())


def rule_type(rule: Mapping[str, Any], allowed: tuple[str, ...]) -> str:
    """``rule["type"]``, which must be one of ``allowed``: another is the task's bug
    (:class:`RuleError`), not the agent's failure."""
    kind = rule.get("type")
    if not isinstance(kind, str) or kind not in allowed:
        raise RuleError(f"unsupported rule type {kind!r} (expected one of {allowed})")
    return kind
