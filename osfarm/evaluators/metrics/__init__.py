"""Registry of OSWorld metric functions: ``METRICS[name] -> metric(result[, expected], **options)``.

Names are OSWorld's, so an evaluator's ``func`` resolves unchanged. Each metric module exposes
a module-level ``METRICS`` dict; a name defined twice is a bug and fails at import.
``infeasible`` is not here: it is decided by the agent's last action (see ``scoring``).
"""

from __future__ import annotations

from collections.abc import Callable

from osfarm.evaluators.metrics import apps, docs, general, media, slides, table

__all__ = ["METRICS"]


def _merge(*modules: object) -> dict[str, Callable[..., float]]:
    merged: dict[str, Callable[..., float]] = {}
    for module in modules:
        for name, func in getattr(module, "METRICS").items():
            if name in merged:
                raise RuntimeError(f"metric {name!r} is defined twice ({module.__name__})")  # type: ignore[attr-defined]
            merged[name] = func
    return merged


METRICS: dict[str, Callable[..., float]] = _merge(general, table, docs, slides, apps, media)
