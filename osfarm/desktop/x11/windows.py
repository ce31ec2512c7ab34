"""Top-level windows of an X display through EWMH (what ``wmctrl`` does, in-process).

Uses ``_NET_CLIENT_LIST``, ``_NET_WM_NAME``/``WM_NAME``, ``WM_CLASS``, ``_NET_ACTIVE_WINDOW`` and
the ``_NET_ACTIVE_WINDOW``/``_NET_CLOSE_WINDOW`` client messages, so it needs an EWMH window
manager (openbox, xfwm4, mutter...). Without one, listing falls back to the root's mapped children.

``wm_class`` strings are ``"instance.Class"`` as in ``wmctrl -lx``.

Thread-safety: opening a python-xlib connection costs ~40 ms (it queries every extension), so one
connection per display is cached at module level and guarded by its own lock; every function here
can be called from any thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from Xlib import X, Xatom
from Xlib import display as xdisplay
from Xlib.error import ConnectionClosedError, XError
from Xlib.protocol import event as xevent

from osfarm.desktop.x11.ewmh import atom as _atom
from osfarm.desktop.x11.ewmh import client_ids as _client_ids
from osfarm.desktop.x11.ewmh import window_title as _title
from osfarm.schema.observation import Window

T = TypeVar("T")

_conns: dict[str, tuple[xdisplay.Display, threading.Lock]] = {}
_conns_lock = threading.Lock()

# How long activate_window waits for the WM to report the window active (it is asynchronous).
_ACTIVATE_WAIT_S = 0.5


def _display_name(display: str | None) -> str:
    name = display or os.environ.get("DISPLAY") or ""
    if not name:
        raise RuntimeError("no X display: pass display= or set $DISPLAY")
    return name


def _with_display(display: str | None, fn: Callable[[xdisplay.Display], T]) -> T:
    """Run ``fn`` with the cached connection to ``display``, reconnecting once if it died."""
    name = _display_name(display)
    for attempt in (0, 1):
        with _conns_lock:
            entry = _conns.get(name)
            if entry is None:
                entry = (xdisplay.Display(name), threading.Lock())
                _conns[name] = entry
        d, lock = entry
        try:
            with lock:
                return fn(d)
        except (ConnectionClosedError, BrokenPipeError, ConnectionResetError):
            with _conns_lock:
                if _conns.get(name) is entry:
                    del _conns[name]
            if attempt:
                raise
    raise AssertionError("unreachable")


def close_connections() -> None:
    """Close the cached connections (tests, shutdown)."""
    with _conns_lock:
        items = list(_conns.values())
        _conns.clear()
    for d, lock in items:
        with lock:
            try:
                d.close()
            except Exception:  # noqa: BLE001 - the server may be gone already
                pass


def _active_id(d: xdisplay.Display) -> int:
    prop = d.screen().root.get_full_property(_atom(d, "_NET_ACTIVE_WINDOW"), Xatom.WINDOW)
    if prop is None or not len(prop.value):
        return 0
    return int(prop.value[0])


def _wm_class(win) -> str:  # noqa: ANN001
    cls = win.get_wm_class()
    if not cls:
        return ""
    return ".".join(cls)


def _describe(d: xdisplay.Display, wid: int, active: int) -> Window | None:
    win = d.create_resource_object("window", wid)
    root = d.screen().root
    try:
        geom = win.get_geometry()
        pos = root.translate_coords(win, 0, 0)
        return Window(
            id=wid, title=_title(d, win), wm_class=_wm_class(win), x=pos.x, y=pos.y,
            width=geom.width, height=geom.height, focused=wid == active,
        )
    except XError:
        return None  # the window went away while we looked at it


def _list(d: xdisplay.Display) -> list[Window]:
    active = _active_id(d)
    out = []
    for wid in _client_ids(d):
        w = _describe(d, wid, active)
        if w is not None:
            out.append(w)
    return out


def list_windows(display: str | None = None) -> list[Window]:
    """Managed top-level windows in stacking-list order (oldest first), geometry in root coords."""
    return _with_display(display, _list)


def _match(w: Window, title: str | None, wm_class: str | None) -> bool:
    if title is not None and title.lower() not in w.title.lower():
        return False
    if wm_class is not None and wm_class.lower() not in w.wm_class.lower():
        return False
    return True


def find_window(title: str | None = None, wm_class: str | None = None, display: str | None = None) -> Window | None:
    """First window whose title and WM_CLASS contain the given substrings (case-insensitive)."""
    for w in list_windows(display):
        if _match(w, title, wm_class):
            return w
    return None


def _wmctrl_match(w: Window, name: str, strict: bool, by_class: bool) -> bool:
    """``wmctrl`` window selection: substring, case-insensitive; ``-F`` exact; ``-x`` on WM_CLASS."""
    hay = w.wm_class if by_class else w.title
    if strict:
        # wmctrl -x -F compares against "instance.Class"; we also accept either half alone.
        return hay == name or (by_class and name in hay.split("."))
    return name.lower() in hay.lower()


def _find_wmctrl(d: xdisplay.Display, name: str, strict: bool, by_class: bool) -> Window | None:
    for w in _list(d):
        if _wmctrl_match(w, name, strict, by_class):
            return w
    return None


def _send_root_message(d: xdisplay.Display, wid: int, atom_name: str, data: list[int]) -> None:
    root = d.screen().root
    ev = xevent.ClientMessage(
        window=d.create_resource_object("window", wid),
        client_type=_atom(d, atom_name),
        data=(32, (data + [0] * 5)[:5]),
    )
    root.send_event(ev, event_mask=X.SubstructureRedirectMask | X.SubstructureNotifyMask)


def activate_window(window_name: str, strict: bool = False, by_class: bool = False, display: str | None = None) -> bool:
    """``wmctrl -a`` (``-F`` strict, ``-x`` by class): switch to the window's desktop, raise and
    focus it. Returns False if no window matches. Waits up to 0.5 s for the WM to confirm."""

    def go(d: xdisplay.Display) -> int | None:
        w = _find_wmctrl(d, window_name, strict, by_class)
        if w is None:
            return None
        root = d.screen().root
        win = d.create_resource_object("window", w.id)
        try:
            desk = win.get_full_property(_atom(d, "_NET_WM_DESKTOP"), Xatom.CARDINAL)
            cur = root.get_full_property(_atom(d, "_NET_CURRENT_DESKTOP"), Xatom.CARDINAL)
            if desk is not None and cur is not None and len(desk.value) and len(cur.value):
                if int(desk.value[0]) != 0xFFFFFFFF and desk.value[0] != cur.value[0]:
                    _send_root_message(d, root.id, "_NET_CURRENT_DESKTOP", [int(desk.value[0]), X.CurrentTime])
            # Source indication 2 ("pager"): a user-requested switch, which WMs' focus-stealing
            # prevention honours (1, "application", may be ignored).
            _send_root_message(d, w.id, "_NET_ACTIVE_WINDOW", [2, X.CurrentTime, 0])
            win.map()
            d.sync()
        except XError:
            return None
        return w.id

    wid = _with_display(display, go)
    if wid is None:
        return False
    deadline = time.monotonic() + _ACTIVATE_WAIT_S
    while time.monotonic() < deadline:
        if _with_display(display, _active_id) == wid:
            break
        time.sleep(0.01)
    return True


def close_window(window_name: str, strict: bool = False, by_class: bool = False, display: str | None = None) -> bool:
    """``wmctrl -c``: ask the WM to close the window gracefully (the app may prompt to save)."""

    def go(d: xdisplay.Display) -> bool:
        w = _find_wmctrl(d, window_name, strict, by_class)
        if w is None:
            return False
        try:
            _send_root_message(d, w.id, "_NET_CLOSE_WINDOW", [X.CurrentTime, 2])
            d.sync()
        except XError:
            return False
        return True

    return _with_display(display, go)


def window_size(app_class_name: str, display: str | None = None) -> tuple[int, int] | None:
    """OSWorld ``/window_size``: size of the first client window whose WM_CLASS instance or class
    equals ``app_class_name`` (case-insensitive); None if there is none."""
    want = app_class_name.lower()

    def go(d: xdisplay.Display) -> tuple[int, int] | None:
        for wid in _client_ids(d):
            win = d.create_resource_object("window", wid)
            try:
                cls = win.get_wm_class()
                if cls and want in (c.lower() for c in cls):
                    g = win.get_geometry()
                    return g.width, g.height
            except XError:
                continue
        return None

    return _with_display(display, go)


def wait_for_window(
    title: str | None, wm_class: str | None, timeout: float, display: str | None = None
) -> Window | None:
    """Poll every 50 ms until a window matching :func:`find_window`'s rules exists; None on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        w = find_window(title, wm_class, display)
        if w is not None:
            return w
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(0.05, left))
