"""OSWorld's getters: ``get_<type>(env, config)`` fetches the state a metric scores.

``GETTERS`` maps an evaluator entry's ``type`` (without the ``get_`` prefix, e.g. ``vm_file``)
to its function; ``env`` is an :class:`~osfarm.evaluators.getters.env.EvalEnv`. The modules
mirror OSWorld's ``desktop_env/evaluators/getters/``: ``files`` (its ``file.py``), ``system``
(its ``misc.py``, ``general.py`` and ``info.py``), ``chrome``, ``vlc``, ``gimp``, ``vscode``,
``impress``; ``devtools`` is how the Chrome getters reach the browser inside the desktop.

Not implemented (they need the internet or a Google account, unsupported offline):
``googledrive_file``, ``info_from_website``, ``pdf_from_url``,
``gotoRecreationPage_and_get_html_content``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from osfarm.evaluators.getters import chrome, files, gimp, impress, system, vlc, vscode
from osfarm.evaluators.getters.env import EvalEnv

UNSUPPORTED_OFFLINE = frozenset(
    {"googledrive_file", "info_from_website", "pdf_from_url", "gotoRecreationPage_and_get_html_content"}
)


def _collect(*modules: ModuleType) -> dict[str, Callable[..., Any]]:
    """``get_<type>`` functions defined in ``modules`` (not those they import), by ``type``; a
    type defined twice is a bug and fails at import."""
    found: dict[str, Callable[..., Any]] = {}
    for module in modules:
        for name, fn in vars(module).items():
            if not (name.startswith("get_") and callable(fn) and getattr(fn, "__module__", None) == module.__name__):
                continue
            kind = name[len("get_"):]
            if kind in found:
                raise RuntimeError(f"getter {kind!r} is defined twice ({module.__name__})")
            found[kind] = fn
    return found


GETTERS: dict[str, Callable[..., Any]] = _collect(files, system, chrome, vlc, gimp, vscode, impress)

__all__ = ["GETTERS", "UNSUPPORTED_OFFLINE", "EvalEnv"]
