"""OSWorld's general metrics: one passing and one failing case each, real files in tmp_path."""

from __future__ import annotations

import datetime as dt
import importlib
import json
import sqlite3
from pathlib import Path

import pytest

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics import METRICS, basic_os, vscode
from osfarm.evaluators.metrics import general as g


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


# --------------------------------------------------------------------------- value metrics


def test_exact_match() -> None:
    assert g.exact_match("Bing", {"expected": "Bing"}) == 1.0
    assert g.exact_match("bing", {"expected": "Bing"}) == 0.0
    assert g.exact_match(None, {"expected": "Bing"}) == 0.0


def test_match_in_list() -> None:
    assert g.match_in_list("Bing", {"expected": ["Bing", "Microsoft Bing"]}) == 1.0
    assert g.match_in_list("Google", {"expected": ["Bing", "Microsoft Bing"]}) == 0.0
    assert g.match_in_list(None, {"expected": ["Bing"]}) == 0.0


def test_is_in_list() -> None:
    assert g.is_in_list(["a.txt", "b.txt"], {"expected": "b.txt"}) == 1.0
    assert g.is_in_list(["a.txt"], {"expected": "b.txt"}) == 0.0
    assert g.is_in_list(None, {"expected": "b.txt"}) == 0.0


def test_literal_match() -> None:
    assert g.literal_match(42, "42") == 1.0
    assert g.literal_match("Yes", "yes") == 0.0
    assert g.literal_match("Yes", "yes", ignore_case=True) == 1.0
    assert g.literal_match(["A", 1], ["a", "1"], type="list", ignore_case=True) == 1.0
    assert g.literal_match(["A", 1], ["A"], type="list") == 0.0
    assert g.literal_match("A", ["A"], type="list") == 0.0
    with pytest.raises(UnsupportedOption):
        g.literal_match("a", "a", type="set")


def test_check_include_exclude() -> None:
    rules = {"include": ["Hello", "world"], "exclude": ["error"]}
    assert g.check_include_exclude("Hello, world!", rules) == 1.0
    assert g.check_include_exclude("Hello, world! error", rules) == 0.0
    assert g.check_include_exclude("Hello", rules) == 0.0
    assert g.check_include_exclude(None, rules) == 0.0


def test_fuzzy_match() -> None:
    assert g.fuzzy_match("kitten", {"expected": "kitten"}) == 1.0
    # rapidfuzz ratio: 1 - 2/12 edits (indel distance 2 over 12 chars) = 0.8333...
    assert g.fuzzy_match("kitten", {"expected": "sitten"}) == pytest.approx(10 / 12)
    assert g.fuzzy_match("abc", {"expected": "xyz"}) == 0.0
    assert g.fuzzy_match(None, {"expected": "xyz"}) == 0.0


def test_check_direct_json_object_default_mode() -> None:
    rules = {"expected": {"name": "Alice", "age": 30}}
    assert g.check_direct_json_object({"name": "Alice", "age": 30, "x": 1}, rules) == 1.0
    assert g.check_direct_json_object({"name": "Alice", "age": 31}, rules) == 0.0
    assert g.check_direct_json_object({"name": "Alice"}, rules) == 0.0  # missing key
    # Command output in Python repr style: single quotes become JSON double quotes.
    assert g.check_direct_json_object("  {'name': 'Alice', 'age': 30}\n", rules) == 1.0
    assert g.check_direct_json_object("not json", rules) == 0.0
    assert g.check_direct_json_object(None, rules) == 0.0
    assert g.check_direct_json_object(["name"], rules) == 0.0


def test_check_direct_json_object_ignore_list_order_and_failed_gold() -> None:
    rules = {"expected": {"tags": ["b", "a"], "ignore_list_order": True}}
    assert g.check_direct_json_object({"tags": ["a", "b"]}, rules) == 1.0
    assert g.check_direct_json_object({"tags": ["a", "c"]}, rules) == 0.0
    assert g.check_direct_json_object({"tags": None}, rules) == 0.0
    assert g.check_direct_json_object({"tags": ["b", "a"]}, {"expected": {"tags": ["a", "b"]}}) == 0.0
    failed = {"expected": {"date": "__EVALUATION_FAILED__"}}
    assert g.check_direct_json_object({"date": "__EVALUATION_FAILED__"}, failed) == 0.0


def test_check_direct_json_object_expect_in_result() -> None:
    rules = {"expect_in_result": True, "expected": {"city": ["Paris", "Lyon"], "title": "Tour"}}
    assert g.check_direct_json_object({"city": "Lyon", "title": "Grand Tour 2024"}, rules) == 1.0
    assert g.check_direct_json_object({"city": ["Nice", "Paris"], "title": "Tour"}, rules) == 1.0
    assert g.check_direct_json_object({"city": "Nice", "title": "Tour"}, rules) == 0.0
    assert g.check_direct_json_object({"city": "Paris", "title": "Trip"}, rules) == 0.0
    assert g.check_direct_json_object({"city": "Paris"}, rules) == 0.0
    assert g.check_direct_json_object({"n": 3}, {"expect_in_result": True, "expected": {"n": 3}}) == 0.0


# --------------------------------------------------------------------------- file metrics


def test_file_metrics_score_none_and_missing_files_zero(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.txt")
    real = write(tmp_path, "real.txt", "x\n")
    for bad in (None, missing):
        assert g.check_list(bad, {"expect": ["x"]}) == 0.0
        assert g.check_csv(bad, {"expect": []}) == 0.0
        assert g.check_json(bad, {"expect": []}) == 0.0
        assert g.check_json(bad, {"expect": []}, is_yaml=True) == 0.0
        assert g.check_line_number(bad, {"expected": 0}) == 0.0
        assert g.file_contains(bad, {"expected": []}) == 0.0
        assert g.diff_text_file(bad, real) == 0.0
        assert g.diff_text_file(real, bad) == 0.0
        assert vscode.compare_text_file(bad, real) == 0.0
        assert vscode.compare_text_file(real, bad) == 0.0
        assert g.fuzzy_place_math(bad, {"expected": ["a"]}) == 0.0
        assert g.compare_time_in_speedtest_results(bad, 60) == 0.0
        assert g.is_included_all_json_objects(bad, real) == 0.0
        assert g.is_included_all_json_objects(real, bad) == 0.0
        assert g.compare_terminal_and_txt(bad, "x\n") == 0.0
        assert g.compare_python_pure_text(bad, real) == 0.0
        assert g.compare_python_pure_text(real, bad) == 0.0
        assert g.run_sqlite3(bad, {"sql": "SELECT 1"}) == 0.0


def test_check_list(tmp_path: Path) -> None:
    path = write(tmp_path, "list.txt", "apple pie\nbanana split\ncherry\n")
    assert g.check_list(path, {"expect": [r"^apple", r"split$"], "unexpect": [r"durian"]}) == 1.0
    assert g.check_list(path, {"expect": [r"^apple", r"^grape"]}) == 0.0
    assert g.check_list(path, {"expect": [r"cherry"], "unexpect": [r"ban+ana"]}) == 0.0


def test_check_csv(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "name,qty\napple,3\npear,5\n")
    assert g.check_csv(path, {"expect": [{"name": "apple", "qty": "3"}], "unexpect": [{"name": "kiwi"}]}) == 1.0
    assert g.check_csv(path, {"expect": [{"name": "apple", "qty": "4"}]}) == 0.0
    assert g.check_csv(path, {"expect": [{"name": "pear"}], "unexpect": [{"qty": "3"}]}) == 0.0


def test_check_json(tmp_path: Path) -> None:
    data = {"editor": {"fontSize": 14, "theme": "Dark+", "rulers": [80]}, "version": "1.2.3"}
    path = write(tmp_path, "settings.json", json.dumps(data))
    rules = {
        "expect": [
            {"key": ["editor", "fontSize"], "method": "eq", "ref": 14},
            {"key": ["editor", "theme"], "method": "re.I", "ref": "^dark"},
            {"key": ["editor", "fontSize"], "method": "approx:0.5", "ref": 14.3},
            {"key": ["editor", "fontSize"], "method": "range.te", "ref": [12, 14]},
            {"key": ["editor", "rulers", 0], "method": "ge", "ref": 80},
            {"key": ["version"], "method": "str_list_eq", "ref": ["1.2.3"]},
        ],
        "unexpect": [{"key": ["editor", "wordWrap"], "method": "eq", "ref": "on"}],
    }
    assert g.check_json(path, rules) == 1.0
    assert g.check_json(path, {"expect": [{"key": ["editor", "fontSize"], "method": "gt", "ref": 14}]}) == 0.0
    assert g.check_json(path, {"expect": [{"key": ["editor", "nope"], "method": "eq", "ref": 1}]}) == 0.0
    assert g.check_json(path, {"unexpect": [{"key": ["version"], "method": "re", "ref": r"^1\."}]}) == 0.0
    broken = write(tmp_path, "broken.json", "{not json")
    assert g.check_json(broken, {"expect": []}) == 0.0


def test_check_json_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "cfg.yaml", "server:\n  port: 8080\n  host: localhost\n")
    ok = {"expect": [{"key": ["server", "port"], "method": "eq", "ref": 8080}]}
    assert g.check_json(path, ok, is_yaml=True) == 1.0
    bad = {"expect": [{"key": ["server", "host"], "method": "eq", "ref": "0.0.0.0"}]}
    assert g.check_json(path, bad, is_yaml=True) == 0.0
    empty = write(tmp_path, "empty.yaml", "")
    assert g.check_json(empty, {"expect": []}, is_yaml=True) == 0.0


def test_check_line_number(tmp_path: Path) -> None:
    path = write(tmp_path, "log.txt", "12:30:01 start\nno time here\n23:59:60 leap\n24:00:00 not a time\n")
    assert g.check_line_number(path, {"expected": 2}) == 1.0
    assert g.check_line_number(path, {"expected": "2"}) == 1.0
    assert g.check_line_number(path, {"expected": 3}) == 0.0


def test_file_contains(tmp_path: Path) -> None:
    path = write(tmp_path, "notes.txt", "alpha beta\ngamma\n")
    assert g.file_contains(path, {"expected": ["alpha", "gamma"]}) == 1.0
    assert g.file_contains(path, {"expected": ["alpha", "delta"]}) == 0.0


def test_diff_text_file(tmp_path: Path) -> None:
    a = write(tmp_path, "a.txt", "one\ntwo\nthree\nfour\n")
    assert g.diff_text_file(a, write(tmp_path, "same.txt", "one\ntwo\nthree\nfour")) == 1.0
    # 3 of 4 lines in common: 2 * 3 / (4 + 4) = 0.75
    assert g.diff_text_file(a, write(tmp_path, "b.txt", "one\ntwo\nTHREE\nfour\n")) == pytest.approx(0.75)
    assert g.diff_text_file(a, write(tmp_path, "c.txt", "x\ny\n")) == 0.0


def test_compare_text_file(tmp_path: Path) -> None:
    a = write(tmp_path, "a.txt", "Hello   World\n\tfoo\n")
    b = write(tmp_path, "b.txt", "hello world foo")
    assert vscode.compare_text_file(a, a) == 1.0
    assert vscode.compare_text_file(a, b) == 0.0
    assert vscode.compare_text_file(a, b, ignore_blanks=True) == 0.0
    assert vscode.compare_text_file(a, b, ignore_blanks=True, ignore_case=True) == 1.0


def test_fuzzy_place_math(tmp_path: Path) -> None:
    import docx

    def make(name: str, lines: list[str]) -> str:
        d = docx.Document()
        for line in lines:
            d.add_paragraph(line)
        path = tmp_path / name
        d.save(str(path))
        return str(path)

    rules = {"expected": ["Paris", "Lyon", "Nice"]}
    assert g.fuzzy_place_math(make("ok.docx", ["Paris", "", " Lyon ", "Nice"]), rules) == 1.0
    # "Pari" vs "Paris": 1 - 1/9 = 8/9; mean of (8/9, 1, 1)
    assert g.fuzzy_place_math(make("typo.docx", ["Pari", "Lyon", "Nice"]), rules) == pytest.approx((8 / 9 + 2) / 3)
    assert g.fuzzy_place_math(make("two.docx", ["Paris", "Lyon"]), rules) == 0.0
    assert g.fuzzy_place_math(write(tmp_path, "fake.docx", "not a zip"), rules) == 0.0


def test_compare_time_in_speedtest_results(tmp_path: Path) -> None:
    path = write(tmp_path, "speed.csv", "Server,Date,Download\nX,2024-01-25 12:56,100\n")
    assert g.compare_time_in_speedtest_results(path, 5, now=dt.datetime(2024, 1, 25, 12, 59)) == 1.0
    assert g.compare_time_in_speedtest_results(path, "5", now=dt.datetime(2024, 1, 25, 13, 10)) == 0.0
    assert g.compare_time_in_speedtest_results(write(tmp_path, "one.csv", "header\n"), 5) == 0.0


def test_is_included_all_json_objects(tmp_path: Path) -> None:
    gold = write(tmp_path, "gold.json", json.dumps({"a": 1, "b": [2]}))
    r1 = write(tmp_path, "r1.json", json.dumps({"a": 1, "b": [2], "c": 3}))
    assert g.is_included_all_json_objects(gold, r1) == 1.0
    assert g.is_included_all_json_objects(gold, write(tmp_path, "r2.json", json.dumps({"a": 1, "b": [3]}))) == 0.0


def test_compare_terminal_and_txt(tmp_path: Path) -> None:
    path = write(tmp_path, "out.txt", "total 0\nfile.txt\n")
    assert g.compare_terminal_and_txt(path, "total 0\nfile.txt\n") == 1.0
    assert g.compare_terminal_and_txt(path, "total 0\n") == 0.0
    assert g.compare_terminal_and_txt(path, None) == 0.0


def test_compare_python_pure_text(tmp_path: Path) -> None:
    gold = write(tmp_path, "gold.py", "def f():\n    return 1\n")
    user = write(tmp_path, "user.py", "#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\ndef f():   \n\n\treturn 1\n")
    assert g.compare_python_pure_text(user, gold) == 1.0
    fenced = write(tmp_path, "fenced.py", "```python\ndef f():\n    return 1\n```\n")
    assert g.compare_python_pure_text(fenced, gold) == 0.0


def test_run_sqlite3(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE urls (url TEXT)")
        conn.execute("INSERT INTO urls VALUES ('https://example.org')")
    conn.close()
    assert g.run_sqlite3(str(db), {"sql": "SELECT COUNT(*) = 1 FROM urls WHERE url LIKE '%example%'"}) == 1.0
    assert g.run_sqlite3(str(db), {"sql": "SELECT COUNT(*) FROM urls WHERE url LIKE '%nope%'"}) == 0.0
    assert g.run_sqlite3(str(db), {"sql": "SELECT * FROM missing_table"}) == 0.0
    # Read-only: a metric's SQL cannot change the evidence.
    assert g.run_sqlite3(str(db), {"sql": "DELETE FROM urls"}) == 0.0
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM urls").fetchone()[0] == 1
    conn.close()


_A11Y = (
    '<desktop-frame xmlns:st="https://accessibility.ubuntu.example.org/ns/state" '
    'xmlns:attr="https://accessibility.ubuntu.example.org/ns/attributes">'
    '<application name="gedit"><push-button name="Save" st:enabled="true">Save</push-button>'
    '<label name="status">Saved 3 files</label></application></desktop-frame>'
)


def test_check_accessibility_tree() -> None:
    assert g.check_accessibility_tree(
        _A11Y, [{"xpath": "//push-button[@st:enabled='true']", "text": "Save", "exact": True}]
    ) == 1.0
    assert g.check_accessibility_tree(_A11Y, [{"selectors": ["application[name=gedit] > label"]}]) == 1.0
    # fuzzy: "Saved 3 files" vs "Saved 2 files", 1 - 2/26
    fuzzy = [{"xpath": "//label", "text": "Saved 2 files", "exact": False}]
    assert g.check_accessibility_tree(_A11Y, fuzzy) == pytest.approx(24 / 26)
    assert g.check_accessibility_tree(_A11Y, [{"xpath": "//push-button", "text": "Open", "exact": True}]) == 0.0
    assert g.check_accessibility_tree(_A11Y, [{"xpath": "//menu"}]) == 0.0
    assert g.check_accessibility_tree(None, [{"xpath": "//menu"}]) == 0.0
    assert g.check_accessibility_tree("<broken", [{"xpath": "//menu"}]) == 0.0


# --------------------------------------------------------------------------- basic_os


def test_check_gnome_favorite_apps() -> None:
    rule = {"expected": ["thunderbird.desktop", "vim.desktop"]}
    assert basic_os.check_gnome_favorite_apps("['vim.desktop', 'thunderbird.desktop']\n", rule) == 1.0
    assert basic_os.check_gnome_favorite_apps("['vim.desktop']", rule) == 0.0
    assert basic_os.check_gnome_favorite_apps("__import__('os').system('true')", rule) == 0.0
    assert basic_os.check_gnome_favorite_apps(None, rule) == 0.0


def test_is_utc_0() -> None:
    out = (
        "               Local time: Thu 2024-01-25 12:56:06 {z}\n"
        "           Universal time: Thu 2024-01-25 12:56:06 UTC\n"
        "                 RTC time: Thu 2024-01-25 12:56:05\n"
        "                Time zone: {name}\n"
        "System clock synchronized: yes\n"
    )
    assert basic_os.is_utc_0(out.format(z="WET", name="Atlantic/Faroe (WET, +0000)")) == 1.0
    assert basic_os.is_utc_0(out.format(z="CET", name="Europe/Paris (CET, +0100)")) == 0.0
    assert basic_os.is_utc_0("") == 0.0


def test_check_text_enlarged() -> None:
    assert basic_os.check_text_enlarged("1.25\n") == 1.0
    assert basic_os.check_text_enlarged("1.0") == 0.0
    assert basic_os.check_text_enlarged(None) == 0.0


def test_check_moved_jpgs() -> None:
    tree = {"name": "photos", "children": [{"name": "a.jpg"}, {"name": "b.jpg"}]}
    assert basic_os.check_moved_jpgs(tree, {"expected": ["b.jpg", "a.jpg"]}) == 1.0
    assert basic_os.check_moved_jpgs(tree, {"expected": ["a.jpg"]}) == 0.0
    assert basic_os.check_moved_jpgs(None, {"expected": ["a.jpg"]}) == 0.0


def test_is_in_vm_clickboard() -> None:
    assert basic_os.is_in_vm_clickboard({"expected": "hello"}, "say hello\n") == 1.0
    assert basic_os.is_in_vm_clickboard({"expected": ["hello", "bye"]}, "say hello\n") == 0.0
    assert basic_os.is_in_vm_clickboard({"expected": ["hello", "say"]}, "say hello\n") == 1.0
    assert basic_os.is_in_vm_clickboard({"expected": "hello"}, None) == 0.0


# --------------------------------------------------------------------------- registry


METRIC_MODULES = ("general", "basic_os", "table", "docs", "slides", "chrome", "vscode", "thunderbird", "gimp",
                  "vlc", "audio_video", "pdf", "archives")


@pytest.mark.parametrize("module_name", METRIC_MODULES)
def test_every_metric_module_registers_its_public_functions_under_their_names(module_name: str) -> None:
    module = importlib.import_module(f"osfarm.evaluators.metrics.{module_name}")
    for name, func in module.METRICS.items():
        assert func.__name__ == name
        assert METRICS[name] is func
    helpers = set(getattr(module, "__all__", ())) - {"METRICS"}  # exported for other metric modules
    public = {
        n for n, f in vars(module).items()
        if callable(f) and getattr(f, "__module__", "") == module.__name__ and not n.startswith("_")
    }
    assert public - helpers == set(module.METRICS), f"every public function of {module_name}.py is a registered metric"


def test_the_registry_is_the_union_of_the_metric_modules() -> None:
    names = [n for m in METRIC_MODULES for n in importlib.import_module(f"osfarm.evaluators.metrics.{m}").METRICS]
    assert len(names) == len(set(names)) == len(METRICS)
    for name in ("exact_match", "check_include_exclude", "check_direct_json_object", "compare_text_file"):
        assert METRICS[name].__name__ == name
