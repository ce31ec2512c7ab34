"""Taking control of a leased desktop from the browser.

Only an admin may, one at a time per desktop, and only on a leased desktop: a ready desktop is
somebody's next clean desktop, so nobody types into it. Every take-over is written on the lease
(``Lease.control``: who, from when, until when), which the lease holder sees in its lease info
and the runner copies into the episode record (``controlled_by``), so a score earned with human
help is never mistaken for the agent's.

Input arrives as computer_13 actions (mouse moves, buttons, wheel, typing, keys) and is checked
with the same validation as an agent's step; code actions and DONE/FAIL are refused: a person
at the keyboard needs neither, and the guest's code runner is not something to hand to a web page.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from osfarm.errors import OsfarmError
from osfarm.farm.pool import ControlSpan, Lease
from osfarm.schema.actions import ActionError, CodeAction, Control, parse_actions

MAX_ACTIONS = 200  # one message: a burst of typing or a fast drag
ALLOWED = frozenset({
    "MOVE_TO", "CLICK", "MOUSE_DOWN", "MOUSE_UP", "RIGHT_CLICK", "DOUBLE_CLICK", "DRAG_TO", "SCROLL",
    "TYPING", "PRESS", "KEY_DOWN", "KEY_UP", "HOTKEY",
})  # fmt: skip


class ControlRefused(OsfarmError):
    """Why this viewer cannot take control now (shown to it)."""


def control_actions(raw: Any, screen: tuple[int, int]) -> list[dict[str, Any]]:
    """A message's actions, validated like an agent's, as JSON for the guest's ``/v1/step``."""
    if not isinstance(raw, list) or not raw:
        raise ActionError("actions", "expected a non-empty list of computer_13 actions")
    if len(raw) > MAX_ACTIONS:
        raise ActionError("actions", f"at most {MAX_ACTIONS} actions a message")
    parsed = parse_actions(raw, *screen)
    out = []
    for i, a in enumerate(parsed):
        if isinstance(a, (CodeAction, Control)) or a.action_type not in ALLOWED:
            raise ActionError(f"actions.{i}", "only mouse and keyboard actions may be sent from the dashboard")
        out.append(a.model_dump(mode="json"))
    return out


Notify = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class _Holder:
    by: str
    span: ControlSpan
    token: object
    lease_id: str  # control is of this lease: a new lease on the desktop is not controlled


@dataclass
class ControlRegistry:
    """Who controls which desktop now, and the live views to tell when that changes."""

    holders: dict[str, _Holder] = field(default_factory=dict)
    listeners: dict[str, set[Notify]] = field(default_factory=dict)

    def holder(self, desktop_id: str) -> str | None:
        h = self.holders.get(desktop_id)
        return h.by if h else None

    def take(self, desktop_id: str, lease: Lease | None, by: str, token: object) -> ControlSpan:
        if lease is None:
            raise ControlRefused("only a leased desktop can be controlled (a free one is someone's next clean desktop)")
        h = self.holders.get(desktop_id)
        if h is not None and h.lease_id != lease.id:  # control of a lease that has ended
            if h.span.ended_at is None:
                h.span.ended_at = time.time()
            del self.holders[desktop_id]
            h = None
        if h is not None and h.token is not token:
            raise ControlRefused(f"{h.by} controls this desktop now")
        if h is not None:
            return h.span
        span = ControlSpan(by=by, started_at=time.time())
        lease.control.append(span)
        self.holders[desktop_id] = _Holder(by, span, token, lease.id)
        return span

    def release(self, desktop_id: str, token: object) -> bool:
        h = self.holders.get(desktop_id)
        if h is None or h.token is not token:
            return False
        h.span.ended_at = time.time()
        del self.holders[desktop_id]
        return True

    def held_by(self, desktop_id: str, token: object) -> bool:
        h = self.holders.get(desktop_id)
        return h is not None and h.token is token

    def lease_of(self, desktop_id: str) -> str | None:
        """The lease the current control is of."""
        h = self.holders.get(desktop_id)
        return h.lease_id if h else None

    def listen(self, desktop_id: str, notify: Notify) -> None:
        self.listeners.setdefault(desktop_id, set()).add(notify)

    def unlisten(self, desktop_id: str, notify: Notify) -> None:
        got = self.listeners.get(desktop_id)
        if got is not None:
            got.discard(notify)
            if not got:
                del self.listeners[desktop_id]

    async def announce(self, desktop_id: str) -> None:
        by = self.holder(desktop_id)
        for notify in list(self.listeners.get(desktop_id, ())):
            await notify({"type": "control", "on": by is not None, "by": by})
