"""The metric contract shared by the metric modules.

A metric is ``metric(result_state[, expected_state], **options) -> float`` and:

* scores what a getter could not fetch (``None``, a path that does not exist) and any unreadable
  or malformed input 0.0 instead of raising (OSWorld raises in some of these cases and then
  silently drops the task; a 0 is the honest score);
* returns a float in [0, 1];
* raises on errors in the *task's own* configuration (:class:`~osfarm.evaluators.errors.RuleError`,
  :class:`~osfarm.evaluators.errors.UnsupportedOption`): they are bugs to fix, not agent failures.

Two decorators enforce it. :func:`never_raises` turns every other exception into 0.0;
:func:`bad_input_scores_zero` only the errors bad files produce (:data:`INPUT_ERRORS`), so that a
missing rule key still raises.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import subprocess
import zipfile
from collections.abc import Callable
from typing import Any
from xml.etree import ElementTree

from mutagen import MutagenError
from PIL import UnidentifiedImageError
from pypdf.errors import PyPdfError

from osfarm.evaluators.errors import RuleError, UnsupportedOption

__all__ = ["INPUT_ERRORS", "bad_input_scores_zero", "is_file", "never_raises", "read_text"]

# The task's fault, never the agent's: always raised.
_TASK_ERRORS: tuple[type[BaseException], ...] = (RuleError, UnsupportedOption)

# Failures of the *inputs* (bad file, wrong format, size mismatch).
INPUT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    IndexError,
    ZeroDivisionError,
    zipfile.BadZipFile,
    ElementTree.ParseError,
    UnidentifiedImageError,
    subprocess.SubprocessError,
    PyPdfError,  # pypdf's own errors do not all derive from the above
    MutagenError,
)


def is_file(path: Any) -> bool:
    """``path`` is a str/PathLike naming an existing regular file (None, "" and lists are not)."""
    return bool(path) and isinstance(path, (str, os.PathLike)) and os.path.isfile(path)


def read_text(path: Any) -> str | None:
    """The file's text, or None when the getter found nothing or the file cannot be read."""
    if not is_file(path):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _in_unit_interval(score: float) -> float:
    return min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0


def never_raises(fn: Callable[..., Any]) -> Callable[..., float]:
    """An unexpected input shape (odd table grid, missing part, a getter's None) scores 0.0
    instead of aborting the whole evaluation; the failure is logged under the metric's module.
    Task configuration errors still raise; the score is clamped to [0, 1]."""
    logger = logging.getLogger(fn.__module__)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> float:
        try:
            score = float(fn(*args, **kwargs))
        except _TASK_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - metrics never raise; any failure scores 0.0
            logger.info("%s failed: %s", fn.__name__, exc)
            return 0.0
        return _in_unit_interval(score)

    return wrapper


def bad_input_scores_zero(fn: Callable[..., Any]) -> Callable[..., float]:
    """Input failures (:data:`INPUT_ERRORS`) score 0.0; any other exception (a missing rule
    key, a task configuration error) propagates. The score is clamped to [0, 1]."""
    logger = logging.getLogger(fn.__module__)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> float:
        try:
            value = fn(*args, **kwargs)
        except _TASK_ERRORS:
            raise
        except INPUT_ERRORS as e:
            logger.info("%s: unreadable input (%s: %s)", fn.__name__, type(e).__name__, e)
            return 0.0
        return _in_unit_interval(float(value))

    return wrapper
