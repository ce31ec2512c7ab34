"""computer_13 actions executed in-process through the XTest extension.

One python-xlib connection per :class:`InputController`; every fake event goes through
``XTestFakeInput`` and an action ends with one ``sync`` round trip, so when ``execute`` returns the
X server has already dispatched the events (no subprocess, no fixed pause).

Typing is keymap-aware, which is what fixes OSWorld's ``<``-typed-as-``>`` bug: pyautogui decides
"needs Shift" from a US-layout table but picks the keycode with ``XKeysymToKeycode``, which on a
pc105 keymap returns the LSGT key (``less greater``) for ``<`` -> Shift+LSGT = ``>``. Here each
character's keysym is looked up in the live keymap and we press the keycode at the level where it
sits (level 0 plain, level 1 with Shift). Characters that are nowhere in the keymap (``ü``, ``€``,
CJK, emoji) are bound to a spare keycode (one with no keysyms) for the duration they are needed.

Remapped spare keycodes are kept bound (least-recently-used reuse) and restored to empty on
:meth:`InputController.close`, not right after the keystroke: clients such as Xlib/Tk resolve a
keycode lazily when they read the event, so restoring immediately races them and they would see
the restored (empty) mapping. Normal keycodes are never modified.

Thread-safety: one internal lock serialises all use of the connection; share one instance.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

from Xlib import XK, X
from Xlib import display as xdisplay
from Xlib.error import XError
from Xlib.ext import xtest
from Xlib.protocol import event as xevent

from osfarm.schema.actions import (
    ActionError,
    Click,
    Control,
    DoubleClick,
    DragTo,
    Hotkey,
    KeyDown,
    KeyUp,
    MouseDown,
    MouseUp,
    MoveTo,
    Press,
    RightClick,
    Scroll,
    Typing,
)

_BUTTONS = {"left": 1, "middle": 2, "right": 3}
# Pause after binding new keysyms to spare keycodes, so clients have refreshed their keymaps
# before the first key event for them arrives (see InputController._prebind).
_REMAP_SETTLE_S = 0.05
# Upper bound for waiting until a WM's synchronous button grab has let our clicks through.
_RELEASE_WAIT_MAX_S = 0.5
_BUTTON_MASKS = {1: X.Button1Mask, 2: X.Button2Mask, 3: X.Button3Mask, 4: X.Button4Mask, 5: X.Button5Mask}

# pyautogui key names (lower-case) -> X keysym names. Single characters are handled separately.
_KEY_KEYSYMS: dict[str, str] = {
    "ctrl": "Control_L", "ctrlleft": "Control_L", "ctrlright": "Control_R",
    "alt": "Alt_L", "altleft": "Alt_L", "altright": "Alt_R",
    "option": "Alt_L", "optionleft": "Alt_L", "optionright": "Alt_R",
    "shift": "Shift_L", "shiftleft": "Shift_L", "shiftright": "Shift_R",
    "win": "Super_L", "winleft": "Super_L", "winright": "Super_R", "super": "Super_L",
    "meta": "Super_L", "command": "Super_L", "cmd": "Super_L",
    "enter": "Return", "return": "Return", "\n": "Return", "\r": "Return", "\t": "Tab",
    "tab": "Tab", "esc": "Escape", "escape": "Escape", "backspace": "BackSpace", "\b": "BackSpace",
    "del": "Delete", "delete": "Delete", "insert": "Insert", "home": "Home", "end": "End",
    "pageup": "Prior", "pgup": "Prior", "pagedown": "Next", "pgdn": "Next",
    "up": "Up", "down": "Down", "left": "Left", "right": "Right", "space": "space",
    "capslock": "Caps_Lock", "numlock": "Num_Lock", "scrolllock": "Scroll_Lock", "pause": "Pause",
    "print": "Print", "printscreen": "Print", "prntscrn": "Print", "prtsc": "Print",
    "prtscr": "Print", "apps": "Menu", "help": "Help", "clear": "Clear", "select": "Select",
    "execute": "Execute", "add": "KP_Add", "subtract": "KP_Subtract", "multiply": "KP_Multiply",
    "divide": "KP_Divide", "decimal": "KP_Decimal", "separator": "KP_Separator",
    "modechange": "Mode_switch", "convert": "Henkan", "nonconvert": "Muhenkan",
    "kana": "Katakana", "kanji": "Kanji", "hangul": "Hangul", "hanguel": "Hangul",
    "hanja": "Hangul_Hanja", "junja": "Hangul_Jeonja", "final": "Hangul_End", "yen": "yen",
    "accept": "Execute",
    **{f"f{i}": f"F{i}" for i in range(1, 25)},
    **{f"num{i}": f"KP_{i}" for i in range(10)},
}
# Media/browser keys have no names in Xlib.XK's default tables: XF86 keysym values.
_KEY_XF86: dict[str, int] = {
    "volumedown": 0x1008FF11, "volumemute": 0x1008FF12, "volumeup": 0x1008FF13,
    "playpause": 0x1008FF14, "stop": 0x1008FF15, "prevtrack": 0x1008FF16, "nexttrack": 0x1008FF17,
    "browserhome": 0x1008FF18, "launchmail": 0x1008FF19, "browsersearch": 0x1008FF1B,
    "browserback": 0x1008FF26, "browserforward": 0x1008FF27, "browserstop": 0x1008FF28,
    "browserrefresh": 0x1008FF29, "sleep": 0x1008FF2F, "browserfavorites": 0x1008FF30,
    "launchmediaselect": 0x1008FF32, "launchapp1": 0x1008FF40, "launchapp2": 0x1008FF41,
}
_TEXT_KEYSYMS = {"\n": "Return", "\r": "Return", "\t": "Tab", "\b": "BackSpace"}


def char_keysym(ch: str) -> int | None:
    """The X keysym that produces the character ``ch``, or None for control characters."""
    if ch in _TEXT_KEYSYMS:
        return XK.string_to_keysym(_TEXT_KEYSYMS[ch])
    cp = ord(ch)
    if cp < 0x20 or 0x7F <= cp < 0xA0 or 0xD800 <= cp < 0xE000:
        return None
    if cp < 0x100:
        return cp  # Latin-1 keysyms equal their code points
    return 0x01000000 | cp  # the Unicode keysym range


def key_keysym(key: str) -> int | None:
    """The keysym for a pyautogui key name or a single character."""
    if len(key) == 1:
        return char_keysym(key)
    k = key.lower()
    if k in _KEY_XF86:
        return _KEY_XF86[k]
    name = _KEY_KEYSYMS.get(k)
    if name is None:
        return None
    ks = XK.string_to_keysym(name)
    if not ks:
        XK.load_keysym_group("xkb")  # Henkan & co live outside the default keysym groups
        ks = XK.string_to_keysym(name)
    return ks or None


class InputController:
    """Executes computer_13 actions on ``display`` (default ``$DISPLAY``) through XTest."""

    def __init__(self, display: str | None = None):
        name = display or os.environ.get("DISPLAY") or ""
        if not name:
            raise RuntimeError("no X display: pass display= or set $DISPLAY")
        self._lock = threading.Lock()
        self._d = xdisplay.Display(name)
        if not self._d.query_extension("XTEST").present:
            raise RuntimeError(f"X display {name} has no XTEST extension")
        self._root = self._d.screen().root
        # keycode -> tuple of keysyms (the core keymap); keysym -> [(level, keycode)]
        self._keymap: dict[int, tuple[int, ...]] = {}
        self._where: dict[int, list[tuple[int, int]]] = {}
        self._shift_code = 0
        self._remapped: OrderedDict[int, int] = OrderedDict()  # spare keycode -> keysym, LRU order
        self._held: dict[str, list[int]] = {}  # KEY_DOWN key -> keycodes pressed for it
        self._released = 0  # button mask released by the current action (see _await_release)
        self._load_keymap()

    # ---- keymap ---------------------------------------------------------------------------

    def _load_keymap(self) -> None:
        info = self._d.display.info
        first, count = info.min_keycode, info.max_keycode - info.min_keycode + 1
        rows = self._d.get_keyboard_mapping(first, count)
        self._keymap = {first + i: tuple(r) for i, r in enumerate(rows)}
        where: dict[int, list[tuple[int, int]]] = {}
        for code, syms in self._keymap.items():
            for level, ks in enumerate(syms[:2]):  # levels 0/1 only: no AltGr/group switching
                if ks:
                    where.setdefault(ks, []).append((level, code))
        for lst in where.values():
            lst.sort()
        self._where = where
        self._remapped = OrderedDict((c, ks) for c, ks in self._remapped.items()
                                     if self._keymap.get(c, ())[:1] == (ks,))
        shift_codes = [c for c in self._d.get_modifier_mapping()[X.ShiftMapIndex] if c]
        self._shift_code = shift_codes[0] if shift_codes else self._d.keysym_to_keycode(XK.XK_Shift_L)

    def _refresh_if_changed(self) -> None:
        """Reload the keymap if anyone (setxkbmap, another client, us) changed it since last time."""
        changed = False
        for _ in range(self._d.pending_events()):
            ev = self._d.next_event()
            if isinstance(ev, xevent.MappingNotify) and ev.request in (X.MappingKeyboard, X.MappingModifier):
                changed = True
        if changed:
            self._load_keymap()

    def _keycode_for(self, keysym: int) -> tuple[int, bool]:
        """(keycode, needs_shift) producing ``keysym``; binds a spare keycode if necessary."""
        found = self._where.get(keysym)
        if found:
            level, code = found[0]
            if code in self._remapped:
                self._remapped.move_to_end(code)
            return code, level == 1
        return self._bind_spare(keysym), False

    def _bind_spare(self, keysym: int) -> int:
        spare = [c for c, syms in self._keymap.items() if not any(syms) and c > 8]
        if spare:
            code = spare[-1]  # from the top, away from keycodes layouts tend to grow into
        elif self._remapped:
            code, old = self._remapped.popitem(last=False)  # reuse the least recently used
            self._where.pop(old, None)
        else:
            raise ActionError("parameters", f"no spare keycode to type keysym {keysym:#x}")
        width = max(2, len(self._keymap.get(code, ())))
        # Same keysym on both levels, so a held Shift or Caps Lock cannot change it.
        self._d.change_keyboard_mapping(code, [(keysym, keysym) + (X.NoSymbol,) * (width - 2)])
        self._keymap[code] = (keysym, keysym)
        self._where[keysym] = [(0, code)]
        self._remapped[code] = keysym
        return code

    def _restore_spares(self) -> None:
        for code in list(self._remapped):
            width = max(2, len(self._keymap.get(code, ())))
            self._d.change_keyboard_mapping(code, [(X.NoSymbol,) * width])
        self._remapped.clear()
        self._d.sync()

    # ---- primitives ---------------------------------------------------------------------------

    def _key(self, code: int, down: bool) -> None:
        xtest.fake_input(self._d, X.KeyPress if down else X.KeyRelease, code)

    def _tap_keysym(self, keysym: int, field: str) -> None:
        code, shift = self._keycode_for(keysym)
        if not code:
            raise ActionError(field, f"keysym {keysym:#x} has no keycode")
        if shift:
            self._key(self._shift_code, True)
        self._key(code, True)
        self._key(code, False)
        if shift:
            self._key(self._shift_code, False)

    def _resolve_key(self, key: str, field: str) -> tuple[int, bool]:
        ks = key_keysym(key)
        if ks is None:
            raise ActionError(field, f"key {key!r} has no X keysym")
        self._prebind([ks])  # e.g. media keys or 'ü' absent from the keymap
        code, shift = self._keycode_for(ks)
        # A named key (enter, ctrl...) is pressed as is; Shift is only implied for characters.
        return code, shift and len(key) == 1

    def _press_down(self, key: str, field: str) -> list[int]:
        code, shift = self._resolve_key(key, field)
        codes = ([self._shift_code] if shift else []) + [code]
        for c in codes:
            self._key(c, True)
        return codes

    def _move(self, x: int, y: int) -> None:
        xtest.fake_input(self._d, X.MotionNotify, x=x, y=y)

    def _button(self, button: int, down: bool) -> None:
        xtest.fake_input(self._d, X.ButtonPress if down else X.ButtonRelease, button)
        if not down:
            self._released |= _BUTTON_MASKS.get(button, 0)

    def _click(self, button: int, times: int = 1) -> None:
        for _ in range(times):
            self._button(button, True)
            self._button(button, False)

    # ---- public API ----------------------------------------------------------------------------

    def execute(self, action: object) -> None:
        """Run one computer_13 action; raises :class:`ActionError` if it cannot be performed."""
        with self._lock:
            self._released = 0
            try:
                self._execute(action)
            finally:
                # One round trip: the server has processed every fake event when we return.
                self._d.sync()
                if self._released:
                    self._await_release(self._released)

    def _await_release(self, mask: int) -> None:
        """Wait (bounded) until the server has *processed* the button releases we sent.

        Window managers (openbox, xfwm4, mutter) passively grab buttons on client windows in
        synchronous mode: the pointer stays frozen, queueing our later button events, until the
        WM replays the press. Keyboard events are not frozen, so a CLICK followed at once by
        TYPING could reach the app before the click (typing into the old caret or widget).
        QueryPointer reports button state as of the last *processed* event, so once the
        released buttons read as up, the whole click has been delivered.
        """
        deadline = time.monotonic() + _RELEASE_WAIT_MAX_S
        while self._root.query_pointer().mask & mask and time.monotonic() < deadline:
            time.sleep(0.0005)

    def _execute(self, a: object) -> None:
        if isinstance(a, Control):
            return
        if isinstance(a, MoveTo):
            self._move(a.parameters.x, a.parameters.y)
        elif isinstance(a, (Click, RightClick, DoubleClick)):
            p = a.parameters
            if (p.x is None) != (p.y is None):
                raise ActionError("parameters", "give both x and y, or neither")
            if p.x is not None and p.y is not None:
                self._move(p.x, p.y)
            if isinstance(a, Click):
                self._click(_BUTTONS[a.parameters.button], a.parameters.num_clicks)
            elif isinstance(a, RightClick):
                self._click(3)
            else:
                self._click(1, 2)
        elif isinstance(a, MouseDown):
            self._button(_BUTTONS[a.parameters.button], True)
        elif isinstance(a, MouseUp):
            self._button(_BUTTONS[a.parameters.button], False)
        elif isinstance(a, DragTo):
            self._drag_to(a.parameters.x, a.parameters.y)
        elif isinstance(a, Scroll):
            dx, dy = a.parameters.dx, a.parameters.dy
            # pyautogui convention: dy > 0 scrolls up (button 4), dx > 0 scrolls right (button 7).
            if dy:
                self._click(4 if dy > 0 else 5, abs(dy))
            if dx:
                self._click(7 if dx > 0 else 6, abs(dx))
        elif isinstance(a, Typing):
            self._type(a.parameters.text)
        elif isinstance(a, Press):
            self._refresh_if_changed()
            codes = self._press_down(a.parameters.key, "parameters.key")
            for c in reversed(codes):
                self._key(c, False)
        elif isinstance(a, KeyDown):
            self._refresh_if_changed()
            key = a.parameters.key
            self._held[key] = self._press_down(key, "parameters.key")
        elif isinstance(a, KeyUp):
            self._refresh_if_changed()
            key = a.parameters.key
            held = self._held.pop(key, None)
            codes = [self._resolve_key(key, "parameters.key")[0]] if held is None else held
            for c in reversed(codes):
                self._key(c, False)
        elif isinstance(a, Hotkey):
            self._refresh_if_changed()
            pressed: list[int] = []
            try:
                for i, key in enumerate(a.parameters.keys):
                    pressed += self._press_down(key, f"parameters.keys.{i}")
            finally:
                for c in reversed(pressed):
                    self._key(c, False)
        else:
            raise ActionError("action_type", f"not a computer_13 action: {type(a).__name__}")

    def _drag_to(self, x: int, y: int) -> None:
        """Press left at the current position, glide to (x, y), release (pyautogui.dragTo)."""
        p = self._root.query_pointer()
        x0, y0 = p.root_x, p.root_y
        self._button(1, True)
        # Intermediate motion events: toolkits only start a drag after motion past a threshold
        # while the button is held, and some ignore a single jump. No sleeps are needed.
        steps = 8
        for i in range(1, steps + 1):
            self._move(x0 + (x - x0) * i // steps, y0 + (y - y0) * i // steps)
        self._d.sync()
        self._button(1, False)

    def _type(self, text: str) -> None:
        self._refresh_if_changed()
        # Validate everything first so a bad character does not leave half the text typed.
        syms: list[int] = []
        i = 0
        while i < len(text):
            ch = text[i]
            if ch == "\r" and text[i + 1 : i + 2] == "\n":
                i += 1  # CRLF is one newline
                continue
            ks = char_keysym(ch)
            if ks is None:
                raise ActionError("parameters.text", f"character {ch!r} at index {i} cannot be typed (no keysym)")
            syms.append(ks)
            i += 1
        self._prebind(syms)
        for ks in syms:
            self._tap_keysym(ks, "parameters.text")

    def _prebind(self, syms: list[int]) -> None:
        """Bind spare keycodes for every keysym missing from the keymap, before typing starts.

        Clients learn about keymap changes from MappingNotify/XkbMapNotify events and refresh
        their cached keymap lazily; a key event that reaches a client before that settles is
        seen as NoSymbol and dropped (observed with Tk under load). So new bindings are made up
        front, in one batch, followed by one short settle pause. The pause is paid only the first
        time a character is needed: bindings stay until close().
        """
        missing = [ks for ks in dict.fromkeys(syms) if ks not in self._where]
        if not missing:
            return
        for ks in missing[: max(1, self._spare_capacity())]:
            self._bind_spare(ks)
        self._d.sync()
        time.sleep(_REMAP_SETTLE_S)

    def _spare_capacity(self) -> int:
        return sum(1 for c, syms in self._keymap.items() if not any(syms) and c > 8) + len(self._remapped)

    def cursor_position(self) -> tuple[int, int]:
        with self._lock:
            p = self._root.query_pointer()
            return p.root_x, p.root_y

    def screen_size(self) -> tuple[int, int]:
        s = self._d.screen()
        return s.width_in_pixels, s.height_in_pixels

    def release_all(self) -> None:
        """Release keys still held by KEY_DOWN (e.g. when an episode ends)."""
        with self._lock:
            for codes in self._held.values():
                for c in reversed(codes):
                    self._key(c, False)
            self._held.clear()
            self._d.sync()

    def close(self) -> None:
        """Release held keys, unbind the spare keycodes we bound, and close the connection."""
        with self._lock:
            try:
                for codes in self._held.values():
                    for c in reversed(codes):
                        self._key(c, False)
                self._held.clear()
                self._restore_spares()
            except (XError, OSError):
                pass
            finally:
                self._d.close()
