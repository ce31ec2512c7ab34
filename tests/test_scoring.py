"""OSWorld's score aggregation with real metrics and hand-computed numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from osfarm.evaluators.metrics import METRICS
from osfarm.evaluators.scoring import UnknownMetricError, is_fail_action, score

RULE = {"type": "rule", "rules": {}}  # an expected getter entry; its content is not read here


def test_single_metric_with_expected() -> None:
    ev = {"func": "exact_match", "result": {"type": "vm_command_line"}, "expected": RULE}
    assert score(ev, ["Bing"], [{"expected": "Bing"}], "DONE", METRICS) == 1.0
    assert score(ev, ["Google"], [{"expected": "Bing"}], "DONE", METRICS) == 0.0


def test_single_metric_without_expected_gets_result_and_options() -> None:
    ev = {"func": "check_text_enlarged", "result": {"type": "vm_command_line"}}
    assert score(ev, ["1.5"], [], None, METRICS) == 1.0
    assert score(ev, ["1.0"], [], None, METRICS) == 0.0


def test_single_metric_options_are_passed(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Hello  World\n")
    b.write_text("hello world")
    ev = {"func": "compare_text_file", "result": {"type": "vm_file"}, "expected": {"type": "cloud_file"}}
    assert score(ev, [str(a)], [str(b)], None, METRICS) == 0.0
    ev["options"] = {"ignore_blanks": True, "ignore_case": True}
    assert score(ev, [str(a)], [str(b)], None, METRICS) == 1.0


def test_configured_expected_whose_file_is_missing_scores_zero(tmp_path: Path) -> None:
    a = tmp_path / "a.txt"
    a.write_text("x")
    ev = {"func": "compare_text_file", "result": {"type": "vm_file"}, "expected": {"type": "cloud_file"}}
    # The expected getter found nothing (None): still passed, the metric scores 0, no TypeError.
    assert score(ev, [str(a)], [None], None, METRICS) == 0.0
    assert score(ev, [None], [None], None, METRICS) == 0.0


def test_infeasible() -> None:
    ev = {"func": "infeasible"}
    assert score(ev, [], [], "FAIL", METRICS) == 1.0
    assert score(ev, [], [], {"action_type": "FAIL"}, METRICS) == 1.0
    assert score(ev, [], [], "DONE", METRICS) == 0.0
    assert score(ev, [], [], None, METRICS) == 0.0


def test_fail_on_a_feasible_task_scores_zero_without_running_metrics() -> None:
    ev = {"func": "exact_match", "result": {"type": "rule"}, "expected": RULE}
    assert score(ev, ["Bing"], [{"expected": "Bing"}], "FAIL", METRICS) == 0.0
    assert score(ev, ["Bing"], [{"expected": "Bing"}], {"action_type": "FAIL"}, METRICS) == 0.0

    def boom(*_: Any, **__: Any) -> float:
        raise AssertionError("metric must not run after FAIL")

    assert score({"func": "boom"}, ["x"], [], "FAIL", {"boom": boom}) == 0.0


def test_is_fail_action() -> None:
    assert is_fail_action("FAIL")
    assert not is_fail_action("fail")
    assert not is_fail_action("pyautogui.click(1, 2)")
    assert not is_fail_action({"action_type": "DONE"})
    assert not is_fail_action(None)


def _list_evaluator(conj: str | None) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "func": ["exact_match", "fuzzy_match", "check_include_exclude"],
        "result": [{"type": "vm_command_line"}] * 3,
        "expected": [RULE, RULE, RULE],
    }
    if conj is not None:
        ev["conj"] = conj
    return ev


EXPECTEDS = [{"expected": "ok"}, {"expected": "kitten"}, {"include": ["a"], "exclude": ["z"]}]


def test_and_returns_mean_when_no_metric_is_zero() -> None:
    # 1.0, fuzzy("sitten", "kitten") = 10/12, 1.0 -> mean (2 + 10/12) / 3
    results = ["ok", "sitten", "abc"]
    want = (1.0 + 10 / 12 + 1.0) / 3
    assert score(_list_evaluator(None), results, EXPECTEDS, "DONE", METRICS) == pytest.approx(want)
    assert score(_list_evaluator("and"), results, EXPECTEDS, "DONE", METRICS) == pytest.approx(want)


def test_and_stops_at_the_first_zero() -> None:
    calls: list[str] = []

    def spy(result: Any, rules: Any) -> float:
        calls.append(result)
        return 1.0

    metrics = {**METRICS, "spy": spy}
    ev = {"func": ["exact_match", "spy"], "result": [RULE, RULE], "expected": [RULE, RULE]}
    assert score(ev, ["no", "x"], [{"expected": "ok"}, {}], None, metrics) == 0.0
    assert calls == []
    assert score(ev, ["ok", "x"], [{"expected": "ok"}, {}], None, metrics) == 1.0
    assert calls == ["x"]


def test_or_returns_one_at_first_full_score_else_max() -> None:
    ev = _list_evaluator("or")
    # fuzzy = 10/12 is the best partial score
    assert score(ev, ["no", "sitten", "zzz"], EXPECTEDS, None, METRICS) == pytest.approx(10 / 12)
    assert score(ev, ["no", "kitten", "zzz"], EXPECTEDS, None, METRICS) == 1.0
    assert score(ev, ["no", "xyz", "zzz"], EXPECTEDS, None, METRICS) == 0.0


def test_list_options_are_index_aligned_and_missing_ones_are_empty(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Hello World")
    b.write_text("hello world")
    ev = {
        "func": ["compare_text_file", "compare_text_file"],
        "result": [{"type": "vm_file"}] * 2,
        "expected": [{"type": "cloud_file"}] * 2,
        "options": [{"ignore_case": True}],  # second entry missing -> {}
    }
    # first: equal ignoring case (1); second: case-sensitive (0) -> "and" gives 0
    assert score(ev, [str(a), str(a)], [str(b), str(b)], None, METRICS) == 0.0
    ev["conj"] = "or"
    assert score(ev, [str(a), str(a)], [str(b), str(b)], None, METRICS) == 1.0
    ev["options"] = [None, {"ignore_case": True}]
    ev["conj"] = "and"
    assert score(ev, [str(a), str(b)], [str(b), str(b)], None, METRICS) == 0.0  # first: case differs
    assert score(ev, [str(b), str(a)], [str(b), str(b)], None, METRICS) == 1.0


def test_null_expected_entry_calls_metric_with_result_only() -> None:
    ev = {
        "func": ["check_text_enlarged", "exact_match"],
        "result": [{"type": "vm_command_line"}] * 2,
        "expected": [None, RULE],
    }
    # check_text_enlarged takes one argument: passing an expected would raise TypeError.
    assert score(ev, ["2.0", "ok"], [None, {"expected": "ok"}], None, METRICS) == 1.0
    assert score(ev, ["1.0", "ok"], [None, {"expected": "ok"}], None, METRICS) == 0.0


def test_getter_missing_file_gives_zero_and_the_or_branch_can_still_pass(tmp_path: Path) -> None:
    present = tmp_path / "p.txt"
    present.write_text("needle\n")
    ev = {
        "func": ["file_contains", "file_contains"],
        "result": [{"type": "vm_file"}] * 2,
        "expected": [RULE, RULE],
        "conj": "or",
    }
    exp = [{"expected": ["needle"]}, {"expected": ["needle"]}]
    assert score(ev, [None, str(present)], exp, None, METRICS) == 1.0
    ev["conj"] = "and"
    assert score(ev, [None, str(present)], exp, None, METRICS) == 0.0


def test_unknown_metric_and_bad_conj_raise() -> None:
    with pytest.raises(UnknownMetricError, match="no_such_metric"):
        score({"func": "no_such_metric"}, [None], [], None, METRICS)
    # Resolved before running, so an "and" short-circuit cannot hide a typo.
    ev = {"func": ["exact_match", "no_such_metric"], "expected": [RULE, None]}
    with pytest.raises(UnknownMetricError):
        score(ev, ["x", None], [{"expected": "y"}], None, METRICS)
    with pytest.raises(ValueError):
        score({"func": ["exact_match"], "conj": "xor", "expected": [RULE]}, ["x"], [{"expected": "x"}], None, METRICS)


def test_scores_are_floats() -> None:
    ev = {"func": "exact_match", "expected": RULE}
    s = score(ev, ["a"], [{"expected": "a"}], None, METRICS)
    assert s == 1.0 and isinstance(s, float)
    assert score({"func": []}, [], [], None, METRICS) == 0.0
