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

The longer quiet is owed, not paid at once (:meth:`InputSettle.before_event`): it exists only to
protect the *next* input event, so ``wait`` returns once the app's first answer has gone quiet for
``QUIET_S`` and records what the next event still owes:
the rest of the longer quiet, counted from the last damage seen, never past the cap after the
event. A key that runs a command (:func:`focus_key`, not a click) and an event that closed a
window or moved the focus (an unmap or destroy of a top-level, a change of ``_NET_ACTIVE_WINDOW``
or of the X input focus) owe the whole cap: OSWorld's 0.1 s after that event, whatever the screen
shows (the offline suite's Impress ...0306 lost its Ctrl+S
right after the Slide Properties dialog closed). An agent's think time between steps pays the debt
for free; back-to-back actions pay it before their first event. The price: an observation taken
right after the action shows the app's first answer only, so what the app does a moment later (the
race dialog's focus move 30-60 ms after a click; a dialog mapped after a button's pressed look)
can be missing from it, where OSWorld's 0.1 s pause would have shown it. The record travels between the
guest and the code runner's children (:meth:`give_owed` / :meth:`take_owed`), so a code action's
first event pays what a computer_13 action owes and the other way round.

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
# root events that say a window closed (SubstructureNotify: unmap, destroy) or the active window changed
ROOT_EVENTS = X.SubstructureNotifyMask | X.PropertyChangeMask
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
        self._active_window = self._d.intern_atom("_NET_ACTIVE_WINDOW")
        self.last_click_reached_nobody = False  # what the wait after the last mouse button found (tests read it)
        self._owed: dict[str, float] | None = None  # what the next input event owes the last one (before_event)
        self._armed = False  # damage and focus were taken after the last wait: the next event's answer is fresh
        self._focus_at_arm = 0  # the X input focus before the event
        self._focus_moved = False  # since arm: a top-level unmapped or destroyed, or the active window changed
        self._last_damage_t = 0.0  # monotonic time damage was last read on this connection
        if self.damage_ok:
            self._d.damage_query_version()  # the server must hear a version before DamageCreate
            root = self._d.screen().root
            root.change_attributes(event_mask=ROOT_EVENTS)
            # NonEmpty: one event when the damage region goes from empty to non-empty; subtracting
            # it re-arms the report, so a burst of painting costs a few events, not one per rectangle.
            self._damage = root.damage_create(3)
            self.arm()

    def _drain(self) -> bool:
        """Read every queued event; True if any was damage (then the report is re-armed). Notes a
        closed top-level or a new active window in ``_focus_moved``."""
        seen = False
        while self._d.pending_events():
            ev = self._d.next_event()
            if type(ev).__name__ == "DamageNotify":
                seen = True
            elif ev.type in (X.UnmapNotify, X.DestroyNotify) or (
                    ev.type == X.PropertyNotify and ev.atom == self._active_window):
                self._focus_moved = True
        if seen:
            self._last_damage_t = time.monotonic()
            self._d.damage_subtract(self._damage)
            self._d.flush()
        return seen

    def _input_focus(self) -> int:
        """The X input focus (a round trip, so it also orders after every request sent so far)."""
        focus = self._d.get_input_focus().focus
        return focus if isinstance(focus, int) else focus.id

    def arm(self) -> None:
        """Forget damage so far: what comes after this is the answer to the next event."""
        if not self.damage_ok:
            return
        self._d.damage_subtract(self._damage)
        self._focus_at_arm = self._input_focus()  # the XSync round trip, and where the focus is
        self._drain()
        self._focus_moved = False
        self._armed = True

    def before_event(self) -> float:
        """Call before each input event: waits what the last event still owes (the module
        docstring), then arms if a wait came since the last arm. Returns the seconds waited; free
        when nothing is owed (after the first event of a burst, or once an agent's think time paid)."""
        waited = self._pay_owed()
        if not self._armed:
            self.arm()
        return waited

    def _pay_owed(self) -> float:
        owed, self._owed = self._owed, None
        t0 = time.monotonic()
        if owed is None or t0 >= owed["until"] or not (owed["quiet"] or owed["hold"]):
            return 0.0
        if not self.damage_ok:
            time.sleep(owed["until"] - t0)
            return time.monotonic() - t0
        self._armed = False
        focus = self._input_focus()
        # drawn since the record: when is not known, so the quiet counts from now
        last = t0 if self._drain() else owed["damage_t"]
        fd = self._d.fileno()
        while True:
            hold = owed["hold"] or self._focus_moved or focus != owed["focus"]
            now = time.monotonic()
            until = owed["until"] if hold else min(last + owed["quiet"], owed["until"])
            if now >= until:
                break
            ready, _, _ = select.select([fd], [], [], until - now)
            if ready and self._drain():
                last = time.monotonic()
        return time.monotonic() - t0

    def give_owed(self) -> dict[str, float] | None:
        """Hand what the next input event owes to another process (a code action's child, or the
        guest after one); this one then owes nothing."""
        owed, self._owed = self._owed, None
        return owed

    def take_owed(self, record: object) -> None:
        """Take over another process's :meth:`give_owed`. It may come from the agent's code:
        anything malformed is dropped, and no record makes the next event wait past ``CAP_S``
        from now or longer than ``QUIET_AFTER_FOCUS_S`` of quiet."""
        self._owed = None
        if self.damage_ok:  # what this connection saw before the handover is the other process's to judge
            self._drain()
            self._focus_moved = False
            self._armed = False
        if not isinstance(record, dict):
            return
        try:
            now = time.monotonic()
            self._owed = {"until": min(float(record["until"]), now + CAP_S),
                          "quiet": min(max(float(record["quiet"]), 0.0), QUIET_AFTER_FOCUS_S),
                          "damage_t": min(float(record["damage_t"]), now),
                          "hold": float(bool(record["hold"])), "focus": float(int(record["focus"]))}
        except (KeyError, TypeError, ValueError, OverflowError):
            self._owed = None

    def wait(self, cap: float = CAP_S, focus_may_move: bool = False, button: bool = False) -> float:
        """Block until the app answered the last input event and went quiet for ``QUIET_S``, or
        ``cap`` seconds passed; returns the seconds waited. ``focus_may_move``: the event was a
        mouse button or a :func:`focus_key`; ``button``: it was a mouse button, which no app may
        have got (see the module docstring). What the next event still owes (the longer quiet,
        the rest of the cap after a closed window or a moved focus) is recorded for
        :meth:`before_event`."""
        t0 = time.monotonic()
        deadline = t0 + cap
        self._armed = False
        if not self.damage_ok:
            time.sleep(cap)
            return cap
        owed_quiet = QUIET_AFTER_FOCUS_S if focus_may_move else 0.0
        focus = self._input_focus()  # XSync: the input is dispatched; damage it caused so far is queued
        nobody = button and self._nobody_under_pointer()
        if button:
            self.last_click_reached_nobody = nobody
        if nobody:  # nobody got the click: nothing deferred can follow it
            owed_quiet = 0.0
        answered = self._drain()
        quiet_until = time.monotonic() + QUIET_S if answered or nobody else deadline
        fd = self._d.fileno()
        while True:
            now = time.monotonic()
            until = min(quiet_until, deadline)
            if now >= until:
                break
            ready, _, _ = select.select([fd], [], [], until - now)
            if ready and self._drain():
                quiet_until = time.monotonic() + QUIET_S
        # A key that runs a command (a hotkey, Enter, Tab, Escape) may open or close a window well
        # after its first repaint (bench/action_timing.py's "typing as a window opens": ctrl+H, then
        # the keys must go to the dialog): no quiet proves it done, so it owes OSWorld's whole pause.
        command_key = focus_may_move and not button
        self._owed = {"until": deadline, "quiet": owed_quiet, "damage_t": self._last_damage_t,
                      "hold": float(command_key or self._focus_moved or focus != self._focus_at_arm),
                      "focus": float(self._focus_at_arm)}
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

