"""OSWorld's VS Code metrics (``metrics/vscode.py``): settings and keybindings JSON, the text of
config and source files, installed extensions, and a task's own test module run against the
agent's files.

Names, signatures and scoring follow OSWorld; the metric contract (``contract.py``) holds.
``check_python_file_by_test_suite`` runs the task's test module in a child interpreter with a
timeout, never in the evaluator's own process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from osfarm.evaluators.metrics.contract import is_file, never_raises, read_text
from osfarm.evaluators.metrics.rules import rule_type

logger = logging.getLogger(__name__)

__all__ = ["METRICS"]


def _load_json(path: Any, skip_first_line: bool = False) -> Any:
    text = read_text(path)
    if text is None:
        return None
    if skip_first_line:
        text = text.split("\n", 1)[1] if "\n" in text else ""
    try:
        return json.loads(text)
    except ValueError:
        return None


@never_raises
def check_json_settings(actual: Any, expected: Mapping[str, Any], **options: Any) -> float:
    """Every key of ``expected["expected"]`` is in the JSON settings file with an equal value."""
    data = _load_json(actual)
    if not isinstance(data, dict):
        return 0.0
    want = expected["expected"]
    return float(all(k in data and data[k] == v for k, v in want.items()))


@never_raises
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


@never_raises
def compare_config(actual: Any, rules: Mapping[str, Any], **options: Any) -> float:
    """The file's whole text equals ``rules["expected"]``."""
    text = read_text(actual)
    if text is None:
        return 0.0
    return float(text == rules["expected"])


@never_raises
def compare_answer(actual: Any, rules: Mapping[str, Any], **options: Any) -> float:
    """The answer string equals ``rules["expected"]``."""
    if not actual:
        return 0.0
    return float(actual == rules["expected"])


@never_raises
def is_extension_installed(actual: Any, rules: Mapping[str, Any], **options: Any) -> float:
    """``rules["expected"]`` is (type ``contain``) / is not (``not_contain``) in the extension
    listing (the output of ``code --list-extensions``). A missing listing scores 0."""
    kind = rule_type(rules, ("contain", "not_contain"))
    if actual is None or not isinstance(actual, (str, list, tuple, set)):
        return 0.0
    present = rules["expected"] in actual
    return float(present if kind == "contain" else not present)

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


@never_raises
def check_python_file_by_test_suite(actual_files: Any, test_file: Any, **options: Any) -> float:
    """Import ``test_file`` and call its ``options["test_function_name"]`` (default ``test``):
    1.0 iff it returns a truthy value.

    Unlike OSWorld, this runs in a child Python process (cwd = the test file's folder, which is
    also put on ``sys.path``), killed after ``options["timeout"]`` seconds (default 60). A crash,
    a missing function or a timeout scores 0.0. ``actual_files`` is not read: the test module
    locates the files it checks itself, as in OSWorld.
    """
    if not is_file(test_file):
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


@never_raises
def compare_result_files(src_path: Any, tgt_path: Any) -> float:
    """Two result files (stripped) agree: if the target is a number, the source contains the
    target's text or parses to a number within 1e-4 of it; otherwise the texts are equal."""
    src, tgt = read_text(src_path), read_text(tgt_path)
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


def compare_text_file(actual: Any, expected: Any, **options: Any) -> float:
    """1 iff two text files are equal.

    Options: ``ignore_blanks`` (runs of whitespace become one space, ends trimmed),
    ``ignore_case``.
    """
    got, want = read_text(actual), read_text(expected)
    if got is None or want is None:
        return 0.0
    if options.get("ignore_blanks", False):
        got = re.sub(r"\s+", " ", got.replace("\t", " ").replace("\n", " ").strip())
        want = re.sub(r"\s+", " ", want.replace("\t", " ").replace("\n", " ").strip())
    if options.get("ignore_case", False):
        got, want = got.lower(), want.lower()
    return float(got == want)


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f
    for f in (
        check_json_settings, check_json_keybindings, compare_config, compare_answer,
        is_extension_installed, check_python_file_by_test_suite, compare_result_files,
        compare_text_file,
    )
}
