"""OSWorld's getters: ``get_<type>(env, config)`` fetches the state a metric scores.

``GETTERS`` maps an evaluator entry's ``type`` (without the ``get_`` prefix, e.g. ``vm_file``)
to its function; ``env`` is an :class:`~osfarm.evaluators.getters.env.EvalEnv`.

Not implemented (they need the internet or a Google account, unsupported offline):
``googledrive_file``, ``info_from_website``, ``pdf_from_url``,
``gotoRecreationPage_and_get_html_content``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from osfarm.evaluators.getters import apps, files, system
from osfarm.evaluators.getters.env import EvalEnv

UNSUPPORTED_OFFLINE = frozenset(
    {"googledrive_file", "info_from_website", "pdf_from_url", "gotoRecreationPage_and_get_html_content"}
)

GETTERS: dict[str, Callable[..., Any]] = {
    name[len("get_"):]: fn
    for module in (files, system, apps)
    for name, fn in vars(module).items()
    if name.startswith("get_") and callable(fn) and getattr(fn, "__module__", None) == module.__name__
}

__all__ = ["GETTERS", "UNSUPPORTED_OFFLINE", "EvalEnv"]
