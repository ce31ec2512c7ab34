"""Spreadsheet metrics compatible with OSWorld's ``metrics/table.py``.

Names, signatures and scoring follow upstream: ``compare_table(result, expected, **options)``
walks ``options["rules"]`` in order and scores 1.0 only if every rule holds; ``compare_csv``
compares files line by line; ``compare_conference_city_in_order`` checks a column of cities
(matched without case or accents, where OSWorld's first version matched exactly). Every
metric is a pure function over file paths and never raises:
a missing/unreadable file, or an unknown rule, scores 0.0.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Number
from typing import Any

import openpyxl
import pandas as pd
from openpyxl.cell.cell import MergedCell
from openpyxl.utils.cell import coordinate_to_tuple
from openpyxl.utils.datetime import to_excel
from openpyxl.worksheet.cell_range import MultiCellRange
from openpyxl.worksheet.worksheet import Worksheet

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics.contract import never_raises
from osfarm.evaluators.metrics.rules import match_value_to_rule

logger = logging.getLogger("osfarm.evaluators.metrics.table")

_ENCODINGS = ("utf-8-sig", "utf-8", "latin-1")


# --------------------------------------------------------------------------------------------
# small helpers


def _read_lines(path: str) -> list[str] | None:
    """Lines of a text file, trying a few encodings (exports from LibreOffice vary)."""
    if not path or not os.path.isfile(path):
        return None
    for enc in _ENCODINGS:
        try:
            with open(path, encoding=enc) as fh:
                return fh.read().splitlines()
        except UnicodeDecodeError:
            continue
        except OSError:
            return None
    return None


def _match_cell_rule(value: Any, rule: Mapping[str, Any]) -> bool:
    """OSWorld's rule language (``rules.match_value_to_rule``) as check_cell, zoom and
    data_validation use it: text methods (``re``, ``str_list_eq`` / ``str_set_eq``) match only
    text values, and ``spreadsheet_range`` (the value a cell range lying between ``ref[0]``, a
    subset, and ``ref[1]``, a superset) is added.
    """
    method: str = rule["method"]
    if method == "spreadsheet_range":
        ref: Any = rule.get("ref")  # [subset, superset], cell range strings
        val = value if isinstance(value, MultiCellRange) else MultiCellRange(str(value))
        lower, upper = MultiCellRange(ref[0]), MultiCellRange(ref[1])
        return all(r in val for r in lower) and all(r in upper for r in val)
    if (method.startswith("re") or method in {"str_list_eq", "str_set_eq"}) and not isinstance(value, str):
        return False
    return match_value_to_rule(value, rule)


def _cell_value(value: Any) -> Any:
    """Normalize an openpyxl cached value to what OSWorld reads from the raw XML.

    Upstream reads ``<v>`` directly, so numbers (and dates, stored as serials) come back as
    floats and strings as str.
    """
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return float(to_excel(value))
    if isinstance(value, Number):
        return float(value)  # type: ignore[arg-type]
    return str(value)


def _read_cell_style(name: str, cell: Any) -> Any:
    """One style property of a cell, with OSWorld's property names and None-for-empty rules."""
    has_value = cell.value is not None
    if name == "number_format":
        return cell.number_format if has_value and cell.data_type == "n" else None
    if name == "font_name":
        return cell.font.name if has_value else None
    if name == "font_family":
        return cell.font.family if has_value else None
    if name == "font_color":
        return cell.font.color.rgb if has_value and cell.font.color is not None else None
    if name == "font_bold":
        return cell.font.bold if has_value else None
    if name == "font_italic":
        return cell.font.italic if has_value else None
    if name == "font_underline":
        return cell.font.underline if has_value else None
    if name == "font_size":
        return cell.font.size if has_value else None
    if name == "fill_type":
        return getattr(cell.fill, "tagname", None)
    if name in {"bgcolor", "fgcolor"}:
        # upstream reads fgColor for both: LibreOffice writes solid fills' colour there
        try:
            return cell.fill.fgColor.rgb
        except AttributeError:
            return None
    if name == "hyperlink":
        return (cell.hyperlink or "") if has_value else None
    if name == "merge":
        return isinstance(cell, MergedCell)
    raise UnsupportedOption(f"unsupported style {name}")


def _lcs_ratio(a: str, b: str) -> float:
    """Indel similarity in [0, 100] (same quantity as rapidfuzz ``fuzz.ratio``)."""
    if not a and not b:
        return 100.0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if ca == cb else max(prev[j], cur[-1]))
        prev = cur
    return 200.0 * prev[-1] / (len(a) + len(b))


# --------------------------------------------------------------------------------------------
# workbook access


class _Book:
    """A workbook opened three ways, lazily: formulas (styles), cached values, pandas frames."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.xl = openpyxl.load_workbook(path)  # raises on bad files: caller scores 0.0
        self.sheet_names: list[str] = list(self.xl.sheetnames)
        self._values: openpyxl.Workbook | None = None
        self._pd: pd.ExcelFile | None = None

    @property
    def values(self) -> openpyxl.Workbook:
        if self._values is None:
            self._values = openpyxl.load_workbook(self.path, data_only=True)
        return self._values

    def frame(self, sheet: str) -> pd.DataFrame:
        if self._pd is None:
            self._pd = pd.ExcelFile(self.path, engine="openpyxl")
        return pd.read_excel(self._pd, sheet)

    def printed(self, sheet: str) -> list[str]:
        """Sheet as printed lines. OSWorld's postconfig exports ``<book>-<sheet>.csv`` with
        LibreOffice; use that when present, else render the cached values ourselves."""
        csv_name = f"{os.path.splitext(self.path)[0]}-{sheet}.csv"
        lines = _read_lines(csv_name)
        if lines is None:
            ws = self.values[sheet]
            lines = [",".join("" if v is None else str(v) for v in row) for row in ws.iter_rows(values_only=True)]
        # trailing blank lines carry no data
        while lines and not lines[-1].strip():
            lines.pop()
        return [line.strip() for line in lines]


def _resolve(idx: int | str, result: _Book, expected: _Book | None) -> tuple[_Book, str]:
    """OSWorld sheet index: int / "RI<n>" / "RN<name>" (result), "EI<n>" / "EN<name>" (expected)."""
    if isinstance(idx, int):
        return result, result.sheet_names[idx]
    book = result if idx[:1] == "R" else expected
    if book is None or idx[:2] not in {"RI", "RN", "EI", "EN"}:
        raise ValueError(f"bad sheet index {idx!r}")
    if idx[1] == "I":
        return book, book.sheet_names[int(idx[2:])]
    return book, idx[2:]


def _sheet(idx: int | str, result: _Book, expected: _Book | None) -> Worksheet:
    book, name = _resolve(idx, result, expected)
    return book.xl[name]


def _sheet_if_any(idx: int | str, result: _Book, expected: _Book | None) -> Worksheet | None:
    """The sheet, or None where the book has no such sheet (a name it lacks, an index past its
    last sheet). OSWorld's chart and pivot loaders read a missing sheet as one without charts or
    pivot tables, so a rule comparing two sheets that both lack them holds."""
    try:
        return _sheet(idx, result, expected)
    except (KeyError, IndexError):
        return None


# --------------------------------------------------------------------------------------------
# rules: each returns bool; exceptions become a failed rule


def _rule_sheet_name(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    return exp is not None and res.sheet_names == exp.sheet_names


def _rule_sheet_data(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    precision = int(r.get("precision", 4))
    df1 = _resolve(r["sheet_idx0"], res, exp)
    df2 = _resolve(r["sheet_idx1"], res, exp)
    a = df1[0].frame(df1[1]).round(precision)
    b = df2[0].frame(df2[1]).round(precision)
    return bool(a.equals(b))


def _rule_sheet_print(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    b1, s1 = _resolve(r["sheet_idx0"], res, exp)
    b2, s2 = _resolve(r["sheet_idx1"], res, exp)
    l1, l2 = b1.printed(s1), b2.printed(s2)
    if r.get("ignore_case", False):
        l1, l2 = [x.lower() for x in l1], [x.lower() for x in l2]
    return l1 == l2


def _rule_sheet_fuzzy(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    b1, s1 = _resolve(r["sheet_idx0"], res, exp)
    b2, s2 = _resolve(r["sheet_idx1"], res, exp)
    ws1, ws2 = b1.values[s1], b2.values[s2]
    for sub in r["rules"]:
        for rng in MultiCellRange(sub["range"]):
            for row, col in rng.cells:
                v1 = str(_cell_value(ws1.cell(row=row, column=col).value))
                v2 = str(_cell_value(ws2.cell(row=row, column=col).value))
                for old, new in sub.get("normalization", []):
                    v1, v2 = v1.replace(old, new), v2.replace(old, new)
                if "trim_leadings" in sub:
                    v1, v2 = v1.lstrip(sub["trim_leadings"]), v2.lstrip(sub["trim_leadings"])
                if "trim_trailings" in sub:
                    v1, v2 = v1.rstrip(sub["trim_trailings"]), v2.rstrip(sub["trim_trailings"])
                if "ignore_chars" in sub:
                    drop = set(sub["ignore_chars"])
                    v1 = "".join(c for c in v1 if c not in drop)
                    v2 = "".join(c for c in v2 if c not in drop)
                if sub.get("ignore_case", False):
                    v1, v2 = v1.lower(), v2.lower()
                kind = sub["type"]
                if kind == "includes":
                    ok = v2 in v1
                elif kind == "included_by":
                    ok = v1 in v2
                elif kind == "fuzzy_match":
                    ok = _lcs_ratio(v1, v2) >= float(sub.get("threshold", 85.0))
                elif kind == "exact_match":
                    ok = v1 == v2
                else:
                    raise UnsupportedOption(kind)
                if not ok:
                    return False
    return True


def _freeze_key(ws: Worksheet) -> tuple[Any, ...]:
    """Freeze boundary that does not move when the user scrolls: (state, xSplit, ySplit)."""
    pane = ws.sheet_view.pane
    if pane is None:
        return ("none",)
    state = (pane.state or "").lower()
    xs, ys = int(pane.xSplit or 0), int(pane.ySplit or 0)
    if state in {"frozen", "frozensplit"}:
        return ("frozen", xs, ys)
    return ("other", xs, ys, pane.topLeftCell)


def _rule_freeze(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    return _freeze_key(_sheet(r["sheet_idx0"], res, exp)) == _freeze_key(_sheet(r["sheet_idx1"], res, exp))


def _rule_zoom(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    ws = _sheet(r["sheet_idx"], res, exp)
    return _match_cell_rule(ws.sheet_view.zoomScale or 100.0, r)


def _rule_check_cell(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    book, name = _resolve(r["sheet_idx"], res, exp)
    cell = book.xl[name][r["coordinate"]]
    for prop, rule in r["props"].items():
        if prop == "value":
            val = _cell_value(book.values[name][r["coordinate"]].value)
        else:
            val = _read_cell_style(prop, cell)
        if not _match_cell_rule(val, rule):
            return False
    return True


def _styles(ws: Worksheet, props: Sequence[str]) -> dict[str, list[Any]]:
    return {c.coordinate: [_read_cell_style(p, c) for p in props] for col in ws.iter_cols() for c in col}


def _rule_style(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    # Conditional-formatting evaluation (upstream uses the `formulas` package) is not done:
    # only static cell styles are compared.
    props = r.get("props", [])
    return _styles(_sheet(r["sheet_idx0"], res, exp), props) == _styles(_sheet(r["sheet_idx1"], res, exp), props)


def _dims(ws: Worksheet, obj: str, props: Iterable[str]) -> dict[Any, dict[str, Any]]:
    holder = ws.row_dimensions if obj == "row" else ws.column_dimensions
    props = set(props)
    return {key: {p: getattr(dim, p) for p in props} for key, dim in holder.items()}


def _rule_row_props(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    props = r.get("props", [])
    a = _dims(_sheet(r["sheet_idx0"], res, exp), "row", props)
    return a == _dims(_sheet(r["sheet_idx1"], res, exp), "row", props)


def _rule_col_props(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    props = r.get("props", [])
    a = _dims(_sheet(r["sheet_idx0"], res, exp), "column", props)
    return a == _dims(_sheet(r["sheet_idx1"], res, exp), "column", props)


def _filters(ws: Worksheet) -> dict[str, Any]:
    af = ws.auto_filter
    cols = []
    for fc in af.filterColumn:
        d: dict[str, Any] = {"col_id": fc.colId, "hidden_button": fc.hiddenButton, "show_button": fc.showButton}
        if fc.filters is not None:
            d["filters_blank"] = fc.filters.blank
            d["filters"] = set(fc.filters.filter)
        if fc.customFilters is not None:
            d["custom_filters_op"] = fc.customFilters._and
            d["custom_filters"] = {(f.operator, f.val) for f in fc.customFilters.customFilter}
        cols.append(d)
    out: dict[str, Any] = {"ref": af.ref, "filter_column": sorted(cols, key=lambda d: d["col_id"])}
    ss = af.sortState
    if ss is not None:
        out["sort_state"] = {
            "sort": ss.columnSort, "case": ss.caseSensitive, "method": ss.sortMethod, "ref": ss.ref,
            "condition": [(c.descending, c.sortBy, c.ref, c.customList) for c in ss.sortCondition],
        }
    return out


def _rule_filter(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    return _filters(_sheet(r["sheet_idx0"], res, exp)) == _filters(_sheet(r["sheet_idx1"], res, exp))


def _rule_data_validation(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    # every validator in the sheet must satisfy at least one of the expected property sets
    validators = _sheet(r["sheet_idx"], res, exp).data_validations.dataValidation
    wanted = r["dv_props"]
    if len(validators) < len(wanted):
        return False
    for dv in validators:
        if not any(all(_match_cell_rule(getattr(dv, attr), m) for attr, m in props.items()) for props in wanted):
            return False
    return True


def _chart_title(title: Any) -> Any:
    try:
        return title.tx.rich.p[0].r[0].t
    except (AttributeError, IndexError, TypeError):
        return None


def _ref_formula(ref: Any) -> str:
    for kind in ("numRef", "strRef"):
        f = getattr(getattr(ref, kind, None), "f", None)
        if f:
            return f
    return ""


def _charts(ws: Worksheet | None, props: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Charts keyed by their data series, with the requested properties (OSWorld chart_props)."""
    props = set(props)
    out: dict[str, dict[str, Any]] = {}
    for ch in ws._charts if ws is not None else ():
        key = ";".join(f"{_ref_formula(s.val)},{_ref_formula(s.cat)}" for s in ch.series)
        info: dict[str, Any] = {}
        if "title" in props:
            info["title"] = _chart_title(ch.title)
        if "legend" in props:
            info["legend"] = ch.legend.position if ch.legend is not None else None
        if "width" in props:
            info["width"] = ch.width
        if "height" in props:
            info["height"] = ch.height
        if "type" in props:
            info["type"] = ch.tagname
        if "direction" in props:
            info["direction"] = getattr(ch, "barDir", None)
        for axis in ("x", "y", "z"):
            if f"{axis}title" in props:
                info[f"{axis}title"] = _chart_title(getattr(getattr(ch, f"{axis}_axis", None), "title", None))
        out[key] = info
    return out


def _rule_chart(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    props = r.get("chart_props", [])
    a = _charts(_sheet_if_any(r["sheet_idx0"], res, exp), props)
    return a == _charts(_sheet_if_any(r["sheet_idx1"], res, exp), props)


def _trim_empty(rows: list[list[Any]]) -> tuple[list[list[Any]], int, int]:
    """Drop empty lists at both ends; also return how many were dropped on the left / right."""
    start = 0
    while start < len(rows) and not rows[start]:
        start += 1
    end = len(rows)
    while end > start and not rows[end - 1]:
        end -= 1
    return rows[start:end], start, len(rows) - end


def _pivots(ws: Worksheet | None, props: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Pivot tables keyed by their source range, with the requested properties (OSWorld
    pivot_props). Source columns whose fields select no items are trimmed from the range, and
    field indices are shifted to match, so an over-wide source does not change the key."""
    props = set(props)
    out: dict[str, dict[str, Any]] = {}
    for pvt in ws._pivots if ws is not None else ():
        per_field = [[(it.h, it.x) for it in f.items if it.x is not None] for f in pvt.pivotFields]
        selection, left, right = _trim_empty(per_field)
        src = pvt.cache.cacheSource
        first, last = src.worksheetSource.ref.split(":")
        r1, c1 = coordinate_to_tuple(first)
        r2, c2 = coordinate_to_tuple(last)
        key = f"{src.type};{(r1, c1 + left)}:{(r2, c2 - right)};{src.worksheetSource.sheet}"
        info: dict[str, Any] = {}
        for prop, attr in (("name", "name"), ("show_total", "visualTotals"), ("show_empty_row", "showEmptyRow"),
                           ("show_empty_col", "showEmptyCol"), ("show_headers", "showHeaders")):
            if prop in props:
                info[prop] = getattr(pvt, attr)
        if "location" in props:
            info["location"] = str(pvt.location)
        if "filter" in props or "selection" in props:
            info["selection"] = selection if "ordered" in props else [set(s) for s in selection]
        if "filter" in props:
            info["filter_fields"] = {f.fld for f in pvt.pageFields}
        # ignore_special_fields drops negative indices (-2 is the "Values" pseudo-field)
        keep_special = "ignore_special_fields" not in props
        if "col_fields" in props:
            info["col_fields"] = [f.x - left for f in pvt.colFields if keep_special or f.x - left >= 0]
        if "row_fields" in props:
            info["row_fields"] = [f.x - left for f in pvt.rowFields if keep_special or f.x - left >= 0]
        if "data_fields" in props:
            named = "data_fields_name" in props
            info["data_fields"] = [
                f"{f.fld - left};{f.name if named else ''};{f.subtotal};{f.showDataAs}" for f in pvt.dataFields
            ]
        out[key] = info
    return out


def _rule_pivot_table(r: Mapping[str, Any], res: _Book, exp: _Book | None) -> bool:
    # sheets without pivot tables on both sides compare equal ({} == {}), as upstream; a sheet
    # the book lacks has none (a noop on "make Sheet2 with pivots" whose gold Sheet2 has none)
    props = r.get("pivot_props", [])
    a = _pivots(_sheet_if_any(r["sheet_idx0"], res, exp), props)
    return a == _pivots(_sheet_if_any(r["sheet_idx1"], res, exp), props)


_RULES: dict[str, Callable[[Mapping[str, Any], _Book, _Book | None], bool]] = {
    "sheet_name": _rule_sheet_name,
    "sheet_data": _rule_sheet_data,
    "sheet_print": _rule_sheet_print,
    "sheet_fuzzy": _rule_sheet_fuzzy,
    "freeze": _rule_freeze,
    "zoom": _rule_zoom,
    "check_cell": _rule_check_cell,
    "style": _rule_style,
    "row_props": _rule_row_props,
    "col_props": _rule_col_props,
    "filter": _rule_filter,
    "data_validation": _rule_data_validation,
    "chart": _rule_chart,
    "pivot_table": _rule_pivot_table,
}
SUPPORTED_RULES: frozenset[str] = frozenset(_RULES)


# --------------------------------------------------------------------------------------------
# public metrics


def compare_table(result: str | None, expected: str | None = None, **options: Any) -> float:
    """1.0 iff every rule in ``options["rules"]`` holds between the result and expected xlsx.

    With no ``rules`` the default is OSWorld's common case: same sheet names and same data in
    every sheet. Unknown rule types score 0.0 (upstream raises; we never raise).
    """
    if not result or not os.path.isfile(result):
        return 0.0
    try:
        res = _Book(result)
    except Exception as exc:  # noqa: BLE001 - corrupt/non-xlsx output of the agent
        logger.info("compare_table: cannot open result %s: %s", result, exc)
        return 0.0
    exp: _Book | None = None
    if expected is not None:
        if not os.path.isfile(expected):
            return 0.0
        try:
            exp = _Book(expected)
        except Exception as exc:  # noqa: BLE001 - metrics never raise; any failure scores 0.0
            logger.info("compare_table: cannot open expected %s: %s", expected, exc)
            return 0.0

    rules = options.get("rules")
    if rules is None:
        if exp is None:
            return 0.0
        rules = [{"type": "sheet_name"}] + [
            {"type": "sheet_data", "sheet_idx0": f"RI{i}", "sheet_idx1": f"EI{i}"} for i in range(len(res.sheet_names))
        ]
    for rule in rules:
        fn = _RULES.get(rule.get("type", ""))
        if fn is None:
            logger.warning("compare_table: unsupported rule %r", rule.get("type"))
            return 0.0
        try:
            ok = fn(rule, res, exp)
        except Exception as exc:  # noqa: BLE001 - missing sheet, bad coordinate, ...: the rule fails
            logger.info("compare_table: rule %s failed with %s", rule.get("type"), exc)
            ok = False
        if not ok:
            return 0.0
    return 1.0


def compare_csv(result: str | None, expected: str | Sequence[str] | None, **options: Any) -> float:
    """1.0 iff the result CSV equals (one of) the expected CSV(s) line by line.

    ``strict`` (default True): when False, lines are stripped. ``ignore_case`` (default False).
    """
    if not result or expected is None:
        return 0.0
    got = _read_lines(result)
    if got is None:
        return 0.0
    candidates = [expected] if isinstance(expected, str) else list(expected)

    def norm(lines: list[str]) -> list[str]:
        if not options.get("strict", True):
            lines = [x.strip() for x in lines]
        if options.get("ignore_case", False):
            lines = [x.lower() for x in lines]
        return lines

    for cand in candidates:
        want = _read_lines(cand)
        if want is not None and norm(got) == norm(want):
            return 1.0
    return 0.0


def _city_key(value: Any) -> str:
    """Lower case, accents and punctuation dropped: "Montréal" and "montreal" read the same."""
    text = unicodedata.normalize("NFKD", "" if value is None else str(value))
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


@never_raises
def compare_conference_city_in_order(actual_city_list_path: str | None, expected_city: Mapping[str, Any]) -> float:
    """1.0 iff every cell of C2:C22 on the active sheet contains its expected city, in order.

    ``expected_city["expected"][i]`` is a city or a list of accepted spellings; a cell matches
    when one of them is a substring of it, compared without case, accents or punctuation.
    """
    if not actual_city_list_path or not os.path.isfile(actual_city_list_path):
        return 0.0
    wanted = expected_city["expected"]
    sheet = openpyxl.load_workbook(actual_city_list_path).active
    cells = [cell.value for row in sheet["C2:C22"] for cell in row]
    if len(wanted) < len(cells):
        return 0.0
    for got, want in zip(cells, wanted, strict=False):
        options = [want] if isinstance(want, str) else list(want)
        key = _city_key(got)
        if not any(_city_key(o) and _city_key(o) in key for o in options):
            return 0.0
    return 1.0


METRICS: dict[str, Callable[..., float]] = {
    "compare_table": compare_table,
    "compare_csv": compare_csv,
    "compare_conference_city_in_order": compare_conference_city_in_order,
}
