"""OSWorld-compatible evaluation: getters fetch state from a desktop, metrics score it, and
``scoring.score`` combines the metric scores exactly as OSWorld's ``DesktopEnv.evaluate`` does.

``score_evaluator`` is ``scoring.score`` with the full metric registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["score_evaluator"]


def score_evaluator(
    evaluator: Mapping[str, Any],
    results: Sequence[Any],
    expecteds: Sequence[Any],
    last_action: Any,
    metrics: Mapping[str, Callable[..., Any]] | None = None,
) -> float:
    """Score one task from its resolved getter states; see ``osfarm.evaluators.scoring.score``.

    ``metrics`` defaults to ``osfarm.evaluators.metrics.METRICS`` (imported on first use, so
    importing this package stays cheap).
    """
    from osfarm.evaluators.scoring import score

    if metrics is None:
        from osfarm.evaluators.metrics import METRICS

        metrics = METRICS
    return score(evaluator, results, expecteds, last_action, metrics)
