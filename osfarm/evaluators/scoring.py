"""OSWorld's score aggregation (``DesktopEnv.evaluate``) as a pure function.

The getters have already run: ``results[i]`` / ``expecteds[i]`` are the states they returned
for the i-th metric (None where a file could not be fetched). This module only decides which
metric to call with what, and how their scores combine:

* ``func == "infeasible"``: 1 iff the agent's last action is FAIL, else 0.
* any other task whose last action is FAIL scores 0, without running a metric.
* ``func`` a list, ``conj == "and"`` (default): 0 at the first metric scoring 0, else the
  mean; ``conj == "or"``: 1 at the first metric scoring 1, else the max.
* ``options`` is index-aligned with ``func`` (a missing or null entry is ``{}``); for a single
  ``func`` it is one dict.
* A metric gets ``(result, expected, **options)`` when the evaluator configures an expected
  entry for it, else ``(result, **options)``. A configured expected whose getter found nothing
  arrives as None and is still passed, so file metrics score it 0 instead of failing on a
  missing argument.

Exceptions raised by a metric propagate: the caller records them as an evaluation error,
which is different from a score of 0 (OSWorld crashes and drops such tasks silently).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from osfarm.errors import OsfarmError

__all__ = ["UnknownMetricError", "is_fail_action", "score"]

INFEASIBLE = "infeasible"


class UnknownMetricError(OsfarmError, KeyError):
    """The evaluator names a metric that is not in the registry."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument
        return str(self.args[0]) if self.args else "unknown metric"


def is_fail_action(action: Any) -> bool:
    """The agent gave up: ``"FAIL"`` (pyautogui action space) or ``{"action_type": "FAIL"}``
    (computer_13)."""
    if isinstance(action, str):
        return action == "FAIL"
    if isinstance(action, Mapping):
        return action.get("action_type") == "FAIL"
    return False


def _as_list(value: Any, n: int) -> list[Any]:
    """An index-aligned list of length ``n``, padded with None."""
    items = list(value) if isinstance(value, (list, tuple)) else []
    return (items + [None] * n)[:n]


def _call(
    metric: Callable[..., Any], result: Any, has_expected: bool, expected: Any, options: Mapping[str, Any]
) -> float:
    value = metric(result, expected, **options) if has_expected else metric(result, **options)
    return float(value)


def _lookup(metrics: Mapping[str, Callable[..., Any]], name: Any) -> Callable[..., Any]:
    try:
        return metrics[name]
    except (KeyError, TypeError):
        raise UnknownMetricError(f"unknown metric {name!r}") from None


def score(
    evaluator: Mapping[str, Any],
    results: Sequence[Any],
    expecteds: Sequence[Any],
    last_action: Any,
    metrics: Mapping[str, Callable[..., Any]],
) -> float:
    """The task's score in [0, 1] from the resolved getter states.

    Args:
        evaluator: the task's ``evaluator`` dict (``func``, ``result``, ``expected``,
            ``options``, ``conj``); only its shape is read here, never its getters.
        results: resolved result states, one per metric (a single ``func`` uses ``results[0]``).
        expecteds: resolved expected states, aligned the same way; may be shorter or empty.
        last_action: the agent's last action (a string, a computer_13 dict, or None).
        metrics: metric name -> function, usually ``osfarm.evaluators.metrics.METRICS``.
    """
    func = evaluator["func"]
    if func == INFEASIBLE:
        return 1.0 if is_fail_action(last_action) else 0.0
    if is_fail_action(last_action):
        return 0.0

    expected_cfg = evaluator.get("expected")
    if not isinstance(func, (list, tuple)):
        metric = _lookup(metrics, func)
        options = evaluator.get("options") or {}
        result = results[0] if results else None
        expected = expecteds[0] if expecteds else None
        return _call(metric, result, bool(expected_cfg), expected, options)

    n = len(func)
    if n == 0:
        return 0.0
    conj = evaluator.get("conj", "and")
    if conj not in ("and", "or"):
        raise ValueError(f"evaluator conj must be 'and' or 'or', not {conj!r}")
    options_list = _as_list(evaluator.get("options"), n)
    expected_cfgs = _as_list(expected_cfg, n)
    results_l = _as_list(results, n)
    expecteds_l = _as_list(expecteds, n)

    # Resolve every name first, as OSWorld does at task load: a typo must not hide behind a
    # short-circuit.
    funcs = [_lookup(metrics, name) for name in func]
    scores: list[float] = []
    for i, metric in enumerate(funcs):
        s = _call(metric, results_l[i], bool(expected_cfgs[i]), expecteds_l[i], options_list[i] or {})
        if conj == "and" and s == 0.0:
            return 0.0
        if conj == "or" and s == 1.0:
            return 1.0
        scores.append(s)
    return sum(scores) / n if conj == "and" else max(scores)
