"""OSWorld's desktop and OS metrics (``metrics/basic_os.py``): GNOME settings, the clock, files
moved in the file manager, the clipboard; each over a getter's command output or directory tree."""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["METRICS"]


def check_gnome_favorite_apps(apps_str: Any, rule: Mapping[str, Any]) -> float:
    """``gsettings get org.gnome.shell favorite-apps`` output (a Python list literal) against
    ``rule["expected"]`` as a set of the same size."""
    if not apps_str:
        return 0.0
    try:
        apps = ast.literal_eval(str(apps_str).strip())  # never eval() command output
    except (ValueError, SyntaxError):
        return 0.0
    if not isinstance(apps, (list, tuple)):
        return 0.0
    want = rule["expected"]
    return float(len(apps) == len(want) and set(apps) == set(want))


def is_utc_0(timedatectl_output: Any) -> float:
    """1 iff ``timedatectl``'s 4th line (Time zone) ends with ``+0000)``."""
    if not timedatectl_output:
        return 0.0
    lines = str(timedatectl_output).split("\n")
    return float(len(lines) > 3 and lines[3].endswith("+0000)"))


def check_text_enlarged(scaling_factor_str: Any) -> float:
    """1 iff GNOME's text-scaling-factor is above 1."""
    try:
        return float(float(scaling_factor_str) > 1.0)
    except (TypeError, ValueError):
        return 0.0


def check_moved_jpgs(directory_list: Any, rule: Mapping[str, Any]) -> float:
    """The children names of a ``list_directory`` tree against ``rule["expected"]`` as a set of
    the same size."""
    if not isinstance(directory_list, Mapping):
        return 0.0
    try:
        names = [node["name"] for node in directory_list["children"]]
    except (KeyError, TypeError):
        return 0.0
    want = rule["expected"]
    return float(len(names) == len(want) and set(names) == set(want))


def is_in_vm_clickboard(config: Mapping[str, Any], terminal_output: Any) -> float:
    """1 iff the clipboard dump (``terminal_output``) contains ``config["expected"]`` (a string,
    or every string of a list). Note the argument order: the rule comes first, as upstream."""
    if not terminal_output:
        return 0.0
    want = config["expected"]
    if isinstance(want, list):
        return float(all(w in terminal_output for w in want))
    return float(want in terminal_output)


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f
    for f in (check_gnome_favorite_apps, is_utc_0, check_text_enlarged, check_moved_jpgs, is_in_vm_clickboard)
}
