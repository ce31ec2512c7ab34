"""Wait after an input event until the screen shows the application's answer, capped at OSWorld's pause.

OSWorld sleeps pyautogui's ``PAUSE`` (0.1 s) after every input call: a guess at how long an app
needs to handle a click before the keys that follow it. The ``settle`` action timing waits for
evidence instead, on its own X connection:

1. an XSync round trip (``GetInputFocus``) first: the server has dispatched the fake events to the
   app's queue before we look (the caller's connection sent them; this one orders after it);
2. X DAMAGE on the root window (it reports drawing in every window below it too): the app's
   answer to an input event is a repaint (a pressed button, a caret, a moved focus, a typed
   character). We wait for the first damage after the event, then for the screen to stay quiet;
   no damage at all within the cap (an app that answers late, or a click that changes nothing)
   costs the full cap, as OSWorld's sleep.

How long "quiet" is depends on the event. After plain keys and pointer motion: ``QUIET_S``, a
frame or two. After an event that may move the keyboard focus or run a command (a mouse button;
a key with a modifier held, Enter, Tab, Escape: :func:`focus_key`): ``QUIET_AFTER_FOCUS_S``,
because apps act on these a moment after their own first repaint. Measured: the Tk dialog of
bench/action_timing.py repaints its entry 3-14 ms after a click and moves the focus 30-60 ms
later, with no drawing in between; LibreOffice Calc runs Ctrl+Home from its idle loop, so arrow
keys sent 12 ms after its first repaint were applied before it (the offline suite's Calc replays
failed that way). Keys sent in that gap land in the old place. No X signal tells a pending app
timer from an idle app, so only a wait covers it, and this one is what keeps ``settle`` as right
as OSWorld's fixed pause there.

A mouse button (``button=True``) that no app gets ends after ``QUIET_S``: the pointer is over the
root window or over the window manager's input-only guard window (GNOME's mutter keeps one under
every window, over the empty desktop), and no window holding ``WM_STATE`` (an app's window) is
there. Nobody reads that click, so nothing deferred can follow it; without this a click on the
empty desktop, which draws nothing, waited the whole cap.

Why not ask the app whether it has handled a click (``_NET_WM_PING``, answered from the app's event
loop, so after it read the click: seen here from GTK 3 and Tk 8.6, which answers without listing it)?
Tried, with a DAMAGE object on the clicked app's own window to see whether it drew where the
click landed: the Tk race dialog answers the ping at once and, under a window manager, repaints
the clicked field at once too, then moves the focus 30-60 ms later from a timer. An answered ping
and a repaint say the app read the click, not that it has finished acting on it; typing after them
landed in the old field (tests/test_settle_timing.py). So a click on an app keeps the longer quiet.

Why not more: ``_NET_WM_SYNC_REQUEST`` needs the SYNC extension's counters, which python-xlib
does not wrap (no ``Xlib.ext.xsync``), and only GTK/Qt windows answer it (Tk, xterm and
LibreOffice's own toolkit do not); AT-SPI focus events arrive over D-Bus with more latency than
the damage they come with. DAMAGE sees every toolkit the same way.

This module imports nothing but python-xlib and the standard library and runs on Python >= 3.8:
the code runner (:mod:`osfarm.desktop.box.coderunner`) ships its source into the agent's
interpreter, which may be the guest's system ``python3``.
"""

from __future__ import annotations

import select
import time

from Xlib import X
from Xlib import display as xdisplay
from Xlib import error as xerror

CAP_S = 0.1  # pyautogui.PAUSE's default: never wait longer than OSWorld would have slept
# How long the screen must stay unchanged after the app's first repaint. Toolkits paint an answer
# in one frame or a few back to back (GTK's frame clock: 16 ms apart at most when busy).
QUIET_S = 0.012
QUIET_AFTER_FOCUS_S = 0.07
# pyautogui key names (lower case) that run commands or move the focus; with them, any key
# pressed while a modifier is held (a hotkey)
FOCUS_KEYS = frozenset({"enter", "return", "\n", "\r", "tab", "\t", "esc", "escape"})
MODIFIER_KEYS = frozenset({"ctrl", "ctrlleft", "ctrlright", "alt", "altleft", "altright", "option", "optionleft",
                           "optionright", "win", "winleft", "winright", "super", "meta", "command", "cmd"})


def focus_key(key: str) -> bool:
    """Whether pressing ``key`` (a pyautogui key name) may move the focus or run a command."""
    k = key.lower() if len(key) > 1 else key
    return k in FOCUS_KEYS or k in MODIFIER_KEYS


class InputSettle:
    """One X connection watching the screen's damage; ``arm`` before an input event, ``wait``
    after it. Not thread-safe: one user at a time (callers hold a step lock)."""

    def __init__(self, display_name: str):
        self._d = xdisplay.Display(display_name)
        # the server's extension and python-xlib's wrapper of it (older ones have none)
        self.damage_ok = self._d.has_extension("DAMAGE") and hasattr(self._d, "damage_subtract")
        self._damage = 0
        self._wm_state = self._d.intern_atom("WM_STATE")
        self.last_click_reached_nobody = False  # what the wait after the last mouse button found (tests read it)
        if self.damage_ok:
            self._d.damage_query_version()  # the server must hear a version before DamageCreate
            root = self._d.screen().root
            # NonEmpty: one event when the damage region goes from empty to non-empty; subtracting
            # it re-arms the report, so a burst of painting costs a few events, not one per rectangle.
            self._damage = root.damage_create(3)
            self.arm()

    def _drain(self) -> bool:
        """Read every queued event; True if any was damage (then the report is re-armed)."""
        seen = False
        while self._d.pending_events():
            ev = self._d.next_event()
            if type(ev).__name__ == "DamageNotify":
                seen = True
        if seen:
            self._d.damage_subtract(self._damage)
            self._d.flush()
        return seen

    def arm(self) -> None:
        """Forget damage so far: what comes after this is the answer to the next event."""
        if not self.damage_ok:
            return
        self._d.damage_subtract(self._damage)
        self._d.sync()
        self._drain()

    def wait(self, cap: float = CAP_S, focus_may_move: bool = False, button: bool = False) -> float:
        """Block until the app answered the last input event and went quiet, or ``cap`` seconds
        passed; returns the seconds waited. ``focus_may_move``: the event was a mouse button
        or a :func:`focus_key`; ``button``: it was a mouse button, which no app may have got (see
        the module docstring). Re-arms for the next event."""
        t0 = time.monotonic()
        deadline = t0 + cap
        if not self.damage_ok:
            time.sleep(cap)
            return cap
        quiet = QUIET_AFTER_FOCUS_S if focus_may_move else QUIET_S
        self._d.sync()  # XSync: the input is dispatched; damage it caused so far is queued
        nobody = button and self._nobody_under_pointer()
        if button:
            self.last_click_reached_nobody = nobody
        if nobody:  # no answer is coming: only the screen going quiet is left to wait for
            quiet = QUIET_S
        answered = self._drain()
        quiet_until = time.monotonic() + quiet if answered or nobody else deadline
        fd = self._d.fileno()
        while True:
            now = time.monotonic()
            until = min(quiet_until, deadline)
            if now >= until:
                break
            ready, _, _ = select.select([fd], [], [], until - now)
            if ready and self._drain():
                quiet_until = time.monotonic() + quiet
        self._d.damage_subtract(self._damage)
        self._d.sync()
        self._drain_events_only()
        return time.monotonic() - t0

    def _nobody_under_pointer(self) -> bool:
        """Whether a click where the pointer is reaches no app: it is over the root window, or over
        an input-only top-level with no app's window (one holding WM_STATE) in it."""
        try:
            top = self._d.screen().root.query_pointer().child
            if not top:
                return True
            if top.get_attributes().win_class != X.InputOnly:
                return False
            return all(w.get_full_property(self._wm_state, X.AnyPropertyType) is None
                       for w in [top, *top.query_tree().children])
        except xerror.XError:  # the window went away while we looked: someone's, maybe
            return False

    def _drain_events_only(self) -> None:
        while self._d.pending_events():
            self._d.next_event()

    def forget(self) -> None:
        """Let go of this process's end of the connection without a word to the server: a forked
        child took the connection over (osfarm.desktop.box.coderunner's zygote)."""
        self._d.display.socket.close()

    def close(self) -> None:
        try:
            if self.damage_ok:
                self._d.damage_destroy(self._damage)
            self._d.close()
        except Exception:  # the server may be gone already (a desktop shutting down)
            pass

