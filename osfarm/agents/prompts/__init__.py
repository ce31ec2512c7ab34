"""Prompt formats (what the model is told and how its reply becomes actions), by name.

``pyautogui`` (OSWorld's code prompt), ``computer_13`` (OSWorld's JSON actions) and ``uitars``
(UI-TARS / DART-GUI ``Thought/Action``). Each module holds one format with its parser;
``messages`` builds the history window and moves images in and out of records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from osfarm.agents.prompts.base import (
    OBSERVATIONS,
    ObservationKind,
    Parsed,
    ParseError,
    PromptFormat,
    StepContext,
)
from osfarm.agents.prompts.computer13 import Computer13Format
from osfarm.agents.prompts.pyautogui_code import PyAutoGUIFormat
from osfarm.agents.prompts.uitars import UITarsFormat

FORMATS: dict[str, Callable[..., PromptFormat]] = {
    "pyautogui": PyAutoGUIFormat, "computer_13": Computer13Format, "uitars": UITarsFormat,
}


def make_format(name: str, **options: Any) -> PromptFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown prompt format {name!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[name](**options)


__all__ = ["FORMATS", "OBSERVATIONS", "Computer13Format", "ObservationKind", "ParseError", "Parsed", "PromptFormat",
           "PyAutoGUIFormat", "StepContext", "UITarsFormat", "make_format"]
