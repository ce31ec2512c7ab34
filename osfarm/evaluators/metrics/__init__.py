"""Registry of OSWorld metric functions: ``METRICS[name] -> metric(result[, expected], **options)``.

Names are OSWorld's, so an evaluator's ``func`` resolves unchanged. The modules mirror OSWorld's
``desktop_env/evaluators/metrics/`` where a module there is one idea (chrome, vscode,
thunderbird, vlc, gimp, docs, slides, table, general, basic_os, pdf); OSWorld's file comparisons
scattered over its app modules live by what they compare (``archives``, ``audio_video``, ``pdf``).
Helpers shared by metric modules: ``contract`` (the 0.0-on-bad-input contract and its
decorators), ``rules`` (the ``{method, ref}`` rule language), ``ssim``, ``color``.

Each metric module exposes a module-level ``METRICS`` dict; a name defined twice is a bug and
fails at import. ``infeasible`` is not here: it is decided by the agent's last action (see
``scoring``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from osfarm.evaluators.metrics import (
    archives,
    audio_video,
    basic_os,
    chrome,
    docs,
    general,
    gimp,
    pdf,
    slides,
    table,
    thunderbird,
    vlc,
    vscode,
)

__all__ = ["METRICS"]


def _merge(*modules: ModuleType) -> dict[str, Callable[..., float]]:
    merged: dict[str, Callable[..., float]] = {}
    for module in modules:
        for name, func in module.METRICS.items():
            if name in merged:
                raise RuntimeError(f"metric {name!r} is defined twice ({module.__name__})")
            merged[name] = func
    return merged


METRICS: dict[str, Callable[..., float]] = _merge(
    general, basic_os, table, docs, slides, chrome, vscode, thunderbird, gimp, vlc, audio_video, pdf, archives
)
