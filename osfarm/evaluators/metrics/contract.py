"""The metric contract shared by the file-based metric modules: odd input scores 0.0."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any


def never_raises(fn: Callable[..., float]) -> Callable[..., float]:
    """An unexpected document shape (odd table grid, missing part) scores 0.0 instead of
    aborting the whole evaluation; the failure is logged under the metric's module."""
    logger = logging.getLogger(fn.__module__)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> float:
        try:
            return float(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - metrics never raise; any failure scores 0.0
            logger.info("%s failed: %s", fn.__name__, exc)
            return 0.0

    return wrapper
