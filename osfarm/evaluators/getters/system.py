"""General and system getters (OSWorld ``getters/misc.py``, ``general.py``, ``info.py``)."""

from __future__ import annotations

import copy
import logging
from datetime import datetime, timedelta
from typing import Any

from osfarm.evaluators.getters.env import EvalEnv

log = logging.getLogger(__name__)

# --- rules (misc.py) -------------------------------------------------------------------------


def get_rule(env: EvalEnv, config: dict[str, Any]) -> Any:
    """The rule as given."""
    return config["rules"]


_DOW = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
_MON = ["", "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
_MONTH = ["", "January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]


def apply_rules_to_timeFormat(fmt: str, day: datetime) -> str:
    """Fill OSWorld's date placeholders (first occurrence of each, in OSWorld's order)."""
    for key, value in (
        ("{DoW}", _DOW[day.weekday()]),
        ("{Month}", _MON[day.month]),
        ("{DayD}", str(day.day)),
        ("{Year}", str(day.year)),
        ("{Month0D}", f"{day.month:02d}"),
        ("{month}", _MONTH[day.month].lower()),
        ("{MonthFull}", _MONTH[day.month]),
        ("{Day0D}", f"{day.day:02d}"),
        ("{MonthD}", str(day.month)),
    ):
        fmt = fmt.replace(key, value, 1)
    return fmt


def _nth_next_month(now: datetime, day: int) -> datetime:
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return datetime(year, month, day)


def _first_monday_months_later(now: datetime, months: int) -> datetime:
    m = now.month - 1 + months
    first = datetime(now.year + m // 12, m % 12 + 1, 1)
    return first + timedelta(days=(7 - first.weekday()) % 7)


def _next_weekday(now: datetime, weekday: int) -> datetime:
    """The given weekday of next week (Mon=0): OSWorld's "next Monday" is always 1-7 days away."""
    return now + timedelta(days=(6 - now.weekday()) + 1 + weekday)


def _resolve(name: str, now: datetime, other: str | None = None) -> datetime:
    if name == "tomorrow":
        return now + timedelta(days=1)
    if name == "this month":
        return now
    if name in ("5th next month", "10th next month", "11th next month"):
        return _nth_next_month(now, int(name.split("th", 1)[0]))
    if name == "this Saturday":
        return now + timedelta(days=5 - now.weekday())
    if name == "this Sunday":
        return now + timedelta(days=6 - now.weekday())
    if name == "next Monday":
        return _next_weekday(now, 0)
    if name == "next Friday":
        # OSWorld: paired with "from: next Monday" it is the Friday after that Monday;
        # alone it is this week's Friday until Thursday, else next week's.
        if other == "next Monday" or now.weekday() >= 4:
            return _next_weekday(now, 4)
        return now + timedelta(days=4 - now.weekday())
    if name == "first monday four months later":
        return _first_monday_months_later(now, 4)
    if name == "first monday eight months later":
        return _first_monday_months_later(now, 8)
    raise ValueError(f"rule_relativeTime: unknown relative time {name!r}")


def _fill(value: Any, day: datetime) -> Any:
    if isinstance(value, list):
        return [apply_rules_to_timeFormat(v, day) for v in value]
    return apply_rules_to_timeFormat(value, day)


def get_rule_relativeTime(env: EvalEnv, config: dict[str, Any]) -> Any:
    """``rules.relativeTime = {from[, to]}``: turn the relative dates into absolute ones (from
    ``env.clock()``) and fill the placeholders of ``rules.expected.time`` (``from`` only) or
    ``rules.expected.from`` / ``.to``. Returns the rules (a copy; the task stays untouched)."""
    rules = copy.deepcopy(config["rules"])
    rel = rules["relativeTime"]
    now = env.clock()
    if now.tzinfo is not None:
        now = now.replace(tzinfo=None)
    expected = rules["expected"]
    if "to" not in rel:
        expected["time"] = _fill(expected["time"], _resolve(rel["from"], now))
    else:
        expected["from"] = _fill(expected["from"], _resolve(rel["from"], now))
        expected["to"] = _fill(expected["to"], _resolve(rel["to"], now, other=rel["from"]))
    return rules


def get_time_diff_range(env: EvalEnv, config: dict[str, Any]) -> Any:
    return config.get("diff_range_in_minutes")


# --- commands (general.py) -------------------------------------------------------------------


def _execute(env: EvalEnv, config: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return env.controller.execute(config["command"], shell=config.get("shell", False))
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.warning("command %r failed: %r", config.get("command"), e)
        return None


def get_vm_command_line(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """stdout of ``command`` run in the desktop (``shell`` optional)."""
    r = _execute(env, config)
    return None if r is None else r.get("output")


def get_vm_command_error(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """stderr of ``command`` run in the desktop."""
    r = _execute(env, config)
    return None if r is None else r.get("error")


def get_vm_terminal_output(env: EvalEnv, config: dict[str, Any]) -> str | None:
    return env.controller.get_terminal_output()


def get_accessibility_tree(env: EvalEnv, *args: Any) -> str | None:
    return env.controller.get_accessibility_tree()


# --- info.py ---------------------------------------------------------------------------------


def get_vm_screen_size(env: EvalEnv, config: dict[str, Any]) -> dict[str, int]:
    """``{"width": w, "height": h}`` as OSWorld's ``/screen_size`` answers."""
    w, h = env.controller.get_screen_size()
    return {"width": int(w), "height": int(h)}


def get_vm_window_size(env: EvalEnv, config: dict[str, Any]) -> dict[str, Any] | None:
    return env.controller.get_window_size(config["app_class_name"])


def get_vm_wallpaper(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """The wallpaper image saved as ``dest`` in the cache dir; None when there is none."""
    data = env.controller.get_wallpaper()
    if not data:
        return None
    return env.save(config["dest"], data)


def get_list_directory(env: EvalEnv, config: dict[str, Any]) -> dict[str, Any] | None:
    """OSWorld's directory tree ``{name, type, children}`` of ``path``; None if missing."""
    return env.controller.get_directory_tree(config["path"])
