"""OSWorld application metrics (Chrome, VS Code, GIMP config, Thunderbird, docs leftovers) over
inputs built in the test: getter-shaped dicts/rows, files in tmp_path, a sqlite history DB."""

from __future__ import annotations

import json
import sqlite3
import zipfile
from pathlib import Path
from typing import Any

import docx
import pytest
from docx.enum.text import WD_TAB_ALIGNMENT
from docx.shared import Inches

from osfarm.evaluators.errors import RuleError
from osfarm.evaluators.metrics import METRICS, chrome, color, docs, gimp, thunderbird, vscode

# The metrics that used to share one module: Chrome, VS Code, Thunderbird, GIMP's config, and the
# Writer metrics added to close test_all's coverage.
APP_METRICS = sorted(
    {*chrome.METRICS, *vscode.METRICS, *thunderbird.METRICS}
    - {"compare_htmls", "compare_text_file"}
    | {"check_config_status", "find_default_font", "check_tabstops", "compare_references",
       "check_highlighted_words", "evaluate_colored_words_in_tables", "compare_unique_train_records"}
)


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------------------------------ Chrome


def test_registry_names_are_osworld_names() -> None:
    for name in APP_METRICS:
        assert METRICS[name].__name__ == name
    assert "is_expected_url_pattern_match" in METRICS and "check_thunderbird_prefs" in METRICS


def test_is_expected_url_pattern_match() -> None:
    rules = {"expected": [r"google\.com/search", r"q=osworld"]}
    assert chrome.is_expected_url_pattern_match("https://www.google.com/search?q=osworld", rules) == 1.0
    assert chrome.is_expected_url_pattern_match({"url": "https://google.com/search?q=osworld"}, rules) == 1.0
    assert chrome.is_expected_url_pattern_match("https://www.google.com/search?q=other", rules) == 0.0
    assert chrome.is_expected_url_pattern_match(None, rules) == 0.0
    assert chrome.is_expected_url_pattern_match({"title": "no url"}, rules) == 0.0


def test_is_expected_active_tab() -> None:
    rule = {"type": "url", "url": "https://www.example.com/"}
    assert chrome.is_expected_active_tab({"url": "http://example.com", "title": "x"}, rule) == 0.0  # scheme differs
    assert chrome.is_expected_active_tab({"url": "HTTPS://EXAMPLE.com/"}, rule) == 1.0
    assert chrome.is_expected_active_tab("https://example.com", rule) == 1.0
    assert chrome.is_expected_active_tab({"url": "https://example.com/other"}, rule) == 0.0
    assert chrome.is_expected_active_tab(None, rule) == 0.0
    with pytest.raises(RuleError):
        chrome.is_expected_active_tab({"url": "https://example.com"}, {"type": "title", "url": "x"})


def test_is_expected_active_tab_approximate() -> None:
    rule = {"type": "url", "url": "https://shop.example.com/item/42?ref=a"}
    assert chrome.is_expected_active_tab_approximate({"url": "https://shop.example.com/item/42?utm=zz"}, rule) == 1.0
    assert chrome.is_expected_active_tab_approximate({"url": "https://shop.example.com/item/43"}, rule) == 0.0
    assert chrome.is_expected_active_tab_approximate({}, rule) == 0.0


def test_is_expected_tabs() -> None:
    rule = {"type": "url", "urls": ["https://a.com/", "https://www.b.org/x"]}
    tabs = [{"title": "B", "url": "https://b.org/x"}, {"title": "A", "url": "https://a.com"}]
    assert chrome.is_expected_tabs(tabs, rule) == 1.0
    assert chrome.is_expected_tabs(tabs[:1], rule) == 0.0
    assert chrome.is_expected_tabs(tabs + [{"url": "https://c.net"}], rule) == 0.0
    assert chrome.is_expected_tabs(None, rule) == 0.0
    assert chrome.is_expected_tabs([{"title": "no url"}, {"title": "x"}], rule) == 0.0


def _bookmark_roots() -> dict[str, Any]:
    return {
        "bookmark_bar": {
            "children": [
                {"type": "folder", "name": "Favorites", "children": []},
                {"type": "url", "name": "Docs", "url": "https://docs.python.org/"},
                {
                    "type": "folder",
                    "name": "Liked Authors",
                    "children": [
                        {"type": "url", "name": "a", "url": "https://author.one/"},
                        {"type": "url", "name": "b", "url": "https://author.two/"},
                    ],
                },
            ]
        },
        "other": {"children": []},
    }


def test_is_expected_bookmarks() -> None:
    roots = _bookmark_roots()
    folders = {"type": "bookmark_bar_folders_names", "names": ["Liked Authors", "Favorites"]}
    assert chrome.is_expected_bookmarks(roots, folders) == 1.0
    assert chrome.is_expected_bookmarks(roots, {**folders, "names": ["Favorites"]}) == 0.0
    urls = {"type": "bookmark_bar_websites_urls", "urls": ["https://docs.python.org/"]}
    assert chrome.is_expected_bookmarks(roots, urls) == 1.0
    assert chrome.is_expected_bookmarks(roots, {**urls, "urls": ["https://python.org/"]}) == 0.0
    liked = {"type": "liked_authors_websites_urls", "urls": [["https://x/", "https://author.one/"], "https://author.two/"]}
    assert chrome.is_expected_bookmarks(roots, liked) == 1.0
    assert chrome.is_expected_bookmarks(roots, {**liked, "urls": ["https://author.one/"]}) == 0.0
    assert chrome.is_expected_bookmarks(roots, {**liked, "names": ["Other"]}) == 0.0
    assert chrome.is_expected_bookmarks(None, folders) == 0.0
    assert chrome.is_expected_bookmarks({"other": {}}, folders) == 0.0
    with pytest.raises(RuleError):
        chrome.is_expected_bookmarks(roots, {"type": "nope"})


def test_is_expected_search_query() -> None:
    rules = {"expect": {"pattern": r"q=drip\+coffee"}}
    assert chrome.is_expected_search_query({"url": "https://www.google.com/search?q=drip+coffee"}, rules) == 1.0
    assert chrome.is_expected_search_query({"url": "https://www.google.com/search?q=tea"}, rules) == 0.0
    assert chrome.is_expected_search_query(None, rules) == 0.0


def test_is_expected_installed_extensions() -> None:
    expected = {"expected": ["uBlock Origin", "Dark Reader"]}
    assert chrome.is_expected_installed_extensions(["Dark Reader", "uBlock Origin", "Other"], expected) == 1.0
    assert chrome.is_expected_installed_extensions(["Dark Reader"], expected) == 0.0
    assert chrome.is_expected_installed_extensions(None, expected) == 0.0


def _sqlite_rows(tmp_path: Path, name: str, create: str, rows: list[tuple[Any, ...]], select: str) -> list[Any]:
    """Build a real Chrome-like sqlite DB and read it back the way the getters do."""
    db = tmp_path / name
    con = sqlite3.connect(db)
    con.execute(create)
    if rows:
        con.executemany(f"INSERT INTO {create.split()[2]} VALUES ({','.join('?' * len(rows[0]))})", rows)
    con.commit()
    out = con.execute(select).fetchall()
    con.close()
    return out


def test_is_cookie_deleted(tmp_path: Path) -> None:
    create = "CREATE TABLE cookies (creation_utc INTEGER, host_key TEXT, name TEXT, value TEXT)"
    rows = _sqlite_rows(tmp_path, "c1", create, [(1, ".github.com", "s", "v"), (2, "example.org", "t", "v")],
                        "SELECT * FROM cookies")
    rule = {"type": "domains", "domains": [".amazon.com"]}
    assert chrome.is_cookie_deleted(rows, rule) == 1.0
    assert chrome.is_cookie_deleted(rows, {"type": "domains", "domains": [".github.com"]}) == 0.0
    assert chrome.is_cookie_deleted([], rule) == 1.0
    assert chrome.is_cookie_deleted(None, rule) == 0.0


def test_check_history_deleted(tmp_path: Path) -> None:
    create = "CREATE TABLE urls (url TEXT, title TEXT, last_visit_time INTEGER)"
    rows = _sqlite_rows(tmp_path, "History", create,
                        [("https://www.youtube.com/watch?v=1", "YT", 1), ("https://news.ycombinator.com/", "HN", 2)],
                        "SELECT url, title, last_visit_time FROM urls")
    assert chrome.check_history_deleted(rows, {"type": "keywords", "keywords": ["amazon"]}) == 1.0
    assert chrome.check_history_deleted(rows, {"type": "keywords", "keywords": ["youtube"]}) == 0.0
    assert chrome.check_history_deleted(None, {"type": "keywords", "keywords": ["youtube"]}) == 0.0


def test_is_shortcut_on_desktop() -> None:
    shortcuts = {"/home/user/Desktop/x.desktop": "[Desktop Entry]\nName=Play Puzzle\nExec=/opt/chrome --app=x\n"}
    assert chrome.is_shortcut_on_desktop(shortcuts, {"type": "name", "name": "Play Puzzle"}) == 1.0
    assert chrome.is_shortcut_on_desktop(shortcuts, {"type": "name", "name": "Play"}) == 0.0
    assert chrome.is_shortcut_on_desktop(shortcuts, {"type": "exec", "exec": "/opt/chrome --app=x"}) == 1.0
    assert chrome.is_shortcut_on_desktop(None, {"type": "name", "name": "Play Puzzle"}) == 0.0


def test_check_font_size() -> None:
    assert chrome.check_font_size({"default_font_size": 20}, {"type": "value", "value": 20}) == 1.0
    assert chrome.check_font_size({"default_font_size": 16}, {"type": "value", "value": 20}) == 0.0
    assert chrome.check_font_size({"default_font_size": 18}, {"type": "range", "min": 16, "max": 20}) == 1.0
    assert chrome.check_font_size({"default_font_size": 16}, {"type": "range", "min": 16, "max": 20}) == 0.0
    assert chrome.check_font_size(None, {"type": "value", "value": 20}) == 0.0


def test_check_enabled_experiments() -> None:
    rule = {"type": "names", "names": ["smooth-scrolling", "tab-groups"]}
    assert chrome.check_enabled_experiments(["smooth-scrolling@1", "tab-groups"], rule) == 1.0
    assert chrome.check_enabled_experiments(["tab-groups"], rule) == 0.0
    assert chrome.check_enabled_experiments(None, rule) == 0.0


# ------------------------------------------------------------------------------------------ VS Code


def test_check_json_settings(tmp_path: Path) -> None:
    path = write(tmp_path / "settings.json", json.dumps({"editor.fontSize": 14, "files.autoSave": "afterDelay"}))
    assert vscode.check_json_settings(path, {"expected": {"files.autoSave": "afterDelay"}}) == 1.0
    assert vscode.check_json_settings(path, {"expected": {"editor.fontSize": 16}}) == 0.0
    assert vscode.check_json_settings(path, {"expected": {"missing.key": 1}}) == 0.0
    assert vscode.check_json_settings(write(tmp_path / "bad.json", "{nope"), {"expected": {}}) == 0.0
    assert vscode.check_json_settings(None, {"expected": {"a": 1}}) == 0.0
    assert vscode.check_json_settings(str(tmp_path / "absent.json"), {"expected": {"a": 1}}) == 0.0


def test_check_json_keybindings(tmp_path: Path) -> None:
    binding = {"key": "ctrl+j", "command": "editor.action.joinLines", "when": "editorTextFocus"}
    commented = "// Place your key bindings in this file\n" + json.dumps([binding])
    path = write(tmp_path / "keybindings.json", commented)
    assert vscode.check_json_keybindings(path, {"expected": binding}) == 1.0
    assert vscode.check_json_keybindings(path, {"expected": {**binding, "key": "ctrl+k"}}) == 0.0
    obj = write(tmp_path / "obj.json", json.dumps(binding))
    assert vscode.check_json_keybindings(obj, {"expected": binding}) == 0.0
    assert vscode.check_json_keybindings(None, {"expected": binding}) == 0.0


def test_compare_config_and_answer(tmp_path: Path) -> None:
    path = write(tmp_path / "conf", "color=dark\n")
    assert vscode.compare_config(path, {"expected": "color=dark\n"}) == 1.0
    assert vscode.compare_config(path, {"expected": "color=light\n"}) == 0.0
    assert vscode.compare_config(None, {"expected": ""}) == 0.0
    assert vscode.compare_answer("42", {"expected": "42"}) == 1.0
    assert vscode.compare_answer("41", {"expected": "42"}) == 0.0
    assert vscode.compare_answer(None, {"expected": "42"}) == 0.0


def test_is_extension_installed() -> None:
    listing = "ms-python.python\nms-toolsai.jupyter\n"
    assert vscode.is_extension_installed(listing, {"type": "contain", "expected": "ms-python.python"}) == 1.0
    assert vscode.is_extension_installed(listing, {"type": "contain", "expected": "golang.go"}) == 0.0
    assert vscode.is_extension_installed(listing, {"type": "not_contain", "expected": "golang.go"}) == 1.0
    assert vscode.is_extension_installed(listing, {"type": "not_contain", "expected": "ms-toolsai.jupyter"}) == 0.0
    assert vscode.is_extension_installed(None, {"type": "not_contain", "expected": "golang.go"}) == 0.0
    with pytest.raises(RuleError):
        vscode.is_extension_installed(listing, {"type": "regex", "expected": "x"})


def test_check_config_status(tmp_path: Path) -> None:
    rc = write(
        tmp_path / "gimprc",
        "# GIMP gimprc\n\n(theme \"Dark\")\n(default-image (width 1920))\n(show-menubar yes)\n   \n",
    )
    assert gimp.check_config_status(rc, {"key": "theme", "value": '"Dark"'}) == 1.0
    assert gimp.check_config_status(rc, {"key": "theme", "value": '"Light"'}) == 0.0
    assert gimp.check_config_status(rc, {"key": ["default-image", "(width"], "value": "1920"}) == 1.0
    assert gimp.check_config_status(rc, {"key": ["default-image", "(height"], "value": "1920"}) == 0.0
    assert gimp.check_config_status(None, {"key": "theme", "value": '"Dark"'}) == 0.0


def test_check_python_file_by_test_suite(tmp_path: Path) -> None:
    write(tmp_path / "solution.py", "def add(a, b):\n    return a + b\n")
    suite = write(
        tmp_path / "test_suite.py",
        "from solution import add\n\ndef test():\n    print('running')\n    return add(2, 3) == 5\n\n"
        "def test_wrong():\n    return add(2, 3) == 6\n\ndef test_hang():\n    import time\n    time.sleep(30)\n",
    )
    assert vscode.check_python_file_by_test_suite([], suite) == 1.0
    assert vscode.check_python_file_by_test_suite([], suite, test_function_name="test_wrong") == 0.0
    assert vscode.check_python_file_by_test_suite([], suite, test_function_name="absent") == 0.0
    assert vscode.check_python_file_by_test_suite([], suite, test_function_name="test_hang", timeout=1) == 0.0
    assert vscode.check_python_file_by_test_suite([], None) == 0.0
    assert vscode.check_python_file_by_test_suite([], write(tmp_path / "broken.py", "def test(:\n")) == 0.0


def test_compare_result_files(tmp_path: Path) -> None:
    gold = write(tmp_path / "gold.txt", "3.14159\n")
    assert vscode.compare_result_files(write(tmp_path / "a.txt", "The answer is 3.14159"), gold) == 1.0
    assert vscode.compare_result_files(write(tmp_path / "b.txt", "3.141592"), gold) == 1.0  # within 1e-4
    assert vscode.compare_result_files(write(tmp_path / "c.txt", "3.15"), gold) == 0.0
    text_gold = write(tmp_path / "g2.txt", "hello world\n")
    assert vscode.compare_result_files(write(tmp_path / "d.txt", "hello world"), text_gold) == 1.0
    assert vscode.compare_result_files(write(tmp_path / "e.txt", "hello"), text_gold) == 0.0
    assert vscode.compare_result_files(None, gold) == 0.0


# ------------------------------------------------------------------------------------------ Thunderbird

PREFS = """// Mozilla User Preferences
user_pref("mail.spam.markAsReadOnSpam", true);
user_pref("mailnews.start_page.enabled", false);
user_pref("mail.identity.id1.fullName", "Anonym Tester");
user_pref("mail.server.server1.check_time", 15);
"""


def test_check_thunderbird_prefs(tmp_path: Path) -> None:
    prefs = write(tmp_path / "prefs.js", PREFS)
    ok = {
        "expect": {
            "mail.spam.markAsReadOnSpam": {"method": "eq", "ref": True},
            "mail.identity.id1.fullName": {"method": "re", "ref": "^Anonym"},
        },
        "unexpect": {"mailnews.start_page.enabled": {"method": "eq", "ref": True}},
    }
    assert thunderbird.check_thunderbird_prefs(prefs, ok) == 1.0
    wrong_value = {"expect": {"mail.server.server1.check_time": {"method": "eq", "ref": 10}}}
    assert thunderbird.check_thunderbird_prefs(prefs, wrong_value) == 0.0
    missing = {"expect": {"mail.not.there": {"method": "eq", "ref": 1}}}
    assert thunderbird.check_thunderbird_prefs(prefs, missing) == 0.0
    unexpected = {"unexpect": {"mailnews.start_page.enabled": {"method": "eq", "ref": False}}}
    assert thunderbird.check_thunderbird_prefs(prefs, unexpected) == 0.0
    assert thunderbird.check_thunderbird_prefs(None, ok) == 0.0


FILTERS = """version="9"
logging="no"
name="Move invoices"
enabled="yes"
type="17"
action="Move to folder"
actionValue="mailbox://nobody@Local%20Folders/Invoices"
condition="AND (subject,contains,invoice) AND (from,contains,\\"billing\\")"
name="Old"
enabled="no"
type="17"
action="Delete"
condition="ALL"
"""


def test_check_thunderbird_filter(tmp_path: Path) -> None:
    path = write(tmp_path / "msgFilterRules.dat", FILTERS)
    rules = {
        "expect": [
            {
                "enabled": "yes",
                "action": "Move to folder",
                "actionValue": "mailbox://nobody@Local%20Folders/Invoices",
                "condition": ["AND (subject,contains,invoice)", 'AND (from,contains,"billing")'],
            }
        ],
        "unexpect": [{"action": "Delete", "enabled": "yes"}],
    }
    assert thunderbird.check_thunderbird_filter(path, rules) == 1.0
    assert thunderbird.check_thunderbird_filter(path, {"expect": [{"name": "Move invoices", "enabled": "no"}]}) == 0.0
    assert thunderbird.check_thunderbird_filter(path, {"unexpect": [{"action": "Delete"}]}) == 0.0
    assert thunderbird.check_thunderbird_filter(None, rules) == 0.0


def _mbox(*messages: tuple[str, str]) -> str:
    return "".join(
        f"FROM - Mon Jan 01 00:00:00 2024\nX-Mozilla-Status: {status}\nSubject: {subject}\n\nbody {subject}\n\n"
        for subject, status in messages
    )


def test_check_thunderbird_folder(tmp_path: Path) -> None:
    gold = write(tmp_path / "gold", _mbox(("a", "0001"), ("b", "0001")))
    same = write(tmp_path / "same", _mbox(("b", "0001"), ("a", "0001"), ("gone", "0009"), ("a", "0001")))
    assert thunderbird.check_thunderbird_folder(same, gold) == 1.0
    other = write(tmp_path / "other", _mbox(("a", "0001")))
    assert thunderbird.check_thunderbird_folder(other, gold) == 0.0
    status = write(tmp_path / "status", _mbox(("a", "0000"), ("b", "0001")))
    assert thunderbird.check_thunderbird_folder(status, gold) == 0.0
    assert thunderbird.check_thunderbird_folder(status, gold, ignore_status=True) == 1.0
    assert thunderbird.check_thunderbird_folder([same, other], [gold, gold]) == 0.0
    assert thunderbird.check_thunderbird_folder([same, same], [gold, gold]) == 1.0
    assert thunderbird.check_thunderbird_folder(None, gold) == 0.0


# ------------------------------------------------------------------------------------------ docs leftovers


def test_find_default_font(tmp_path: Path) -> None:
    xcu = write(
        tmp_path / "registrymodifications.xcu",
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<oor:items xmlns:oor="http://openoffice.org/2001/registry" xmlns:xs="http://www.w3.org/2001/XMLSchema">\n'
        '<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="Standard" oor:op="fuse">'
        "<value>Wrong</value></prop></item>\n"
        '<item oor:path="/org.openoffice.Office.Writer/DefaultFont"><prop oor:name="Standard" oor:op="fuse">'
        "<value>Times New Roman</value></prop></item>\n</oor:items>\n",
    )
    assert docs.find_default_font(xcu, {"font_name": "Times New Roman"}) == 1.0
    assert docs.find_default_font(xcu, {"font_name": "Wrong"}) == 0.0
    assert docs.find_default_font(write(tmp_path / "bad.xcu", "<oor:items"), {"font_name": "X"}) == 0.0
    assert docs.find_default_font(None, {"font_name": "Times New Roman"}) == 0.0


def _docx(path: Path, paragraphs: list[str], tabs: list[list[tuple[float, Any]]] | None = None) -> str:
    doc = docx.Document()
    for i, text in enumerate(paragraphs):
        p = doc.add_paragraph(text)
        for inches, align in (tabs[i] if tabs else []):
            p.paragraph_format.tab_stops.add_tab_stop(Inches(inches), align)
    doc.save(path)
    return str(path)


def test_check_tabstops(tmp_path: Path) -> None:
    lines = ["Alpha beta\t1", "Gamma delta\t2"]
    right = WD_TAB_ALIGNMENT.RIGHT
    gold = _docx(tmp_path / "gold.docx", lines, [[(6.0, right)], [(6.0, right)]])
    same = _docx(tmp_path / "same.docx", lines, [[(6.0, right)], [(6.0, right)]])
    assert docs.check_tabstops(same, gold) == pytest.approx(1.0)
    assert docs.check_tabstops(same, gold, word_number_split_by_tabstop=2) == pytest.approx(1.0)
    assert docs.check_tabstops(same, gold, word_number_split_by_tabstop=3) == 0.0
    off = _docx(tmp_path / "off.docx", lines, [[(3.0, right)], [(6.0, right)]])
    assert 0.0 < docs.check_tabstops(off, gold) < 1.0
    left = _docx(tmp_path / "left.docx", lines, [[(6.0, WD_TAB_ALIGNMENT.LEFT)], [(6.0, right)]])
    assert docs.check_tabstops(left, gold) == 0.0
    none = _docx(tmp_path / "none.docx", lines)
    assert docs.check_tabstops(none, gold) == 0.0
    assert docs.check_tabstops(None, gold) == 0.0


def test_compare_references(tmp_path: Path) -> None:
    refs = ["Smith, J. (2020). A study. Journal 1.", "Doe, A. (2019). Another. Journal 2."]
    gold = _docx(tmp_path / "gold.docx", ["Body text", "References", *refs])
    assert docs.compare_references(_docx(tmp_path / "same.docx", ["Body", "References", *refs]), gold) == 1.0
    close = _docx(tmp_path / "close.docx", ["References", refs[0], refs[1].replace("2019", "2018")])
    assert 0.5 < docs.compare_references(close, gold) < 1.0
    wrong = _docx(tmp_path / "wrong.docx", ["References", "zzzz", "qqqq"])
    assert docs.compare_references(wrong, gold) == 0.0
    assert docs.compare_references(_docx(tmp_path / "short.docx", ["References", refs[0]]), gold) == 0.0
    assert docs.compare_references(_docx(tmp_path / "noref.docx", ["Body"]), gold) == 0.0
    assert docs.compare_references(None, gold) == 0.0


def _odt(path: Path, highlighted: bool) -> str:
    color = "#ffff00" if highlighted else "transparent"
    content = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<office:document-content xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
        'xmlns:style="urn:oasis:names:tc:opendocument:xmlns:style:1.0" '
        'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" '
        'xmlns:fo="urn:oasis:names:tc:opendocument:xmlns:xsl-fo-compatible:1.0">'
        '<office:automatic-styles><style:style style:name="T1" style:family="text">'
        f'<style:text-properties fo:background-color="{color}"/></style:style></office:automatic-styles>'
        "<office:body><office:text>"
        '<text:p>Plain text and <text:span text:style-name="T1">marked words</text:span> here.</text:p>'
        "</office:text></office:body></office:document-content>"
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("mimetype", "application/vnd.oasis.opendocument.text")
        zf.writestr("content.xml", content)
    return str(path)


def test_check_highlighted_words(tmp_path: Path) -> None:
    gold = _odt(tmp_path / "gold.odt", highlighted=False)
    assert docs.check_highlighted_words(_odt(tmp_path / "clean.odt", highlighted=False), gold) == 1.0
    assert docs.check_highlighted_words(_odt(tmp_path / "marked.odt", highlighted=True), gold) == 0.0
    assert docs.check_highlighted_words(None, gold) == 0.0
    assert docs.check_highlighted_words(write(tmp_path / "junk.odt", "not a zip"), gold) == 0.0


def test_compare_unique_train_records(tmp_path: Path) -> None:
    initial_lines = ["08:00:00, T1, S1, 1", "08:05:00, T2, S2, 2", "08:10:00, T1, S1, 1", "08:15:00, T3, S3, 3"]
    initial = _docx(tmp_path / "initial.docx", initial_lines)
    gold = _docx(tmp_path / "gold.docx", [initial_lines[0], initial_lines[1], initial_lines[3]])
    good = _docx(tmp_path / "good.docx", [initial_lines[3], initial_lines[0], initial_lines[1]])
    assert docs.compare_unique_train_records(good, [gold, initial]) == 1.0
    dup = _docx(tmp_path / "dup.docx", initial_lines)
    assert docs.compare_unique_train_records(dup, [gold, initial]) == 0.0
    invented = _docx(tmp_path / "inv.docx", [initial_lines[0], initial_lines[1], "09:00:00, T3, S9, 9"])
    assert docs.compare_unique_train_records(invented, [gold, initial]) == 0.0
    assert docs.compare_unique_train_records(good, gold) == 0.0
    assert docs.compare_unique_train_records(None, [gold, initial]) == 0.0


@pytest.mark.parametrize("name", APP_METRICS)
def test_none_inputs_score_zero_and_never_raise(name: str) -> None:
    """Every metric, handed None where a getter found nothing, scores 0.0 (a well-formed rule)."""
    rules: dict[str, Any] = {
        "is_expected_active_tab": {"type": "url", "url": "https://a.com"},
        "is_expected_active_tab_approximate": {"type": "url", "url": "https://a.com"},
        "is_expected_url_pattern_match": {"expected": ["a"]},
        "is_expected_search_query": {"expect": {"pattern": "a"}},
        "is_expected_installed_extensions": {"expected": ["a"]},
        "is_expected_tabs": {"type": "url", "urls": ["https://a.com"]},
        "is_expected_bookmarks": {"type": "bookmark_bar_folders_names", "names": ["a"]},
        "is_cookie_deleted": {"type": "domains", "domains": ["a.com"]},
        "check_history_deleted": {"type": "keywords", "keywords": ["a"]},
        "is_shortcut_on_desktop": {"type": "name", "name": "a"},
        "check_font_size": {"type": "value", "value": 1},
        "check_enabled_experiments": {"type": "names", "names": []},
        "check_json_settings": {"expected": {}},
        "check_json_keybindings": {"expected": {}},
        "compare_config": {"expected": ""},
        "compare_answer": {"expected": ""},
        "is_extension_installed": {"type": "not_contain", "expected": "a"},
        "check_config_status": {"key": "a", "value": "b"},
        "check_thunderbird_prefs": {},
        "check_thunderbird_filter": {},
        "find_default_font": {"font_name": "a"},
    }
    func = METRICS[name]
    assert func(None, rules.get(name)) == 0.0


def _colored_table(path: Path, colors: dict[str, tuple[int, int, int] | None]) -> str:
    from docx.shared import RGBColor

    doc = docx.Document()
    doc.add_paragraph("Word table")
    table = doc.add_table(rows=1, cols=len(colors))
    for cell, (word, rgb) in zip(table.rows[0].cells, colors.items(), strict=True):
        run = cell.paragraphs[0].add_run(word)
        if rgb is not None:
            run.font.color.rgb = RGBColor(*rgb)
    doc.save(path)
    return str(path)


def test_evaluate_colored_words_in_tables(tmp_path: Path) -> None:
    gold = _colored_table(tmp_path / "gold.docx", {"apple": (255, 0, 0), "pear": (0, 0, 255)})
    near = _colored_table(tmp_path / "near.docx", {"apple": (250, 5, 0), "pear": (0, 0, 250)})
    assert docs.evaluate_colored_words_in_tables(near, gold) == 1.0
    swapped = _colored_table(tmp_path / "swap.docx", {"apple": (0, 0, 255), "pear": (255, 0, 0)})
    assert docs.evaluate_colored_words_in_tables(swapped, gold) == 0.0
    plain = _colored_table(tmp_path / "plain.docx", {"apple": None, "pear": (0, 0, 255)})
    assert docs.evaluate_colored_words_in_tables(plain, gold) == 0.0
    other_text = _docx(tmp_path / "other.docx", ["Different text"])
    assert docs.evaluate_colored_words_in_tables(other_text, gold) == 0.0
    assert docs.evaluate_colored_words_in_tables(None, gold) == 0.0
    # the CIEDE2000 implementation against Sharma et al.'s published test pairs
    assert color.delta_e_2000((50, 2.6772, -79.7751), (50, 0, -82.7485)) == pytest.approx(2.0425, abs=1e-4)
    assert color.delta_e_2000((50, 2.5, 0), (73, 25, -18)) == pytest.approx(27.1492, abs=1e-4)
