"""The message of an HTTP error reply, as every osfarm server writes one (``{"detail": ...}``) and
as the servers we talk to write theirs (OSWorld's guest: ``message`` or ``error``); and
:class:`GuestError`, what a client of a desktop's guest routes raises on one
(:class:`osfarm.tasks.controller.GuestController`; the evaluators catch it too, so it lives here,
below both)."""

from __future__ import annotations

import json

from osfarm.errors import InfraError

DETAIL_KEYS = ("detail", "message", "error")


def error_detail(content: bytes | str, fallback: str = "", limit: int = 500) -> str:
    """The first non-empty ``detail``/``message``/``error`` of a JSON object body; else the body
    text (cut to ``limit`` characters); else ``fallback`` (e.g. the reason phrase)."""
    text = content.decode("utf-8", "replace") if isinstance(content, bytes) else content
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        for key in DETAIL_KEYS:
            if body.get(key):
                return str(body[key])[:limit]
    return text.strip()[:limit] or fallback


class GuestError(InfraError, RuntimeError):
    """A guest route answered an error; ``route``, ``status`` and ``message`` say which and why."""

    def __init__(self, route: str, status: int | None, message: str):
        self.route, self.status, self.message = route, status, message
        where = f"{route} ({status})" if status is not None else route
        super().__init__(f"guest {where}: {message}")
