"""The X server's state a warm reset records at the baseline and puts back: keys and buttons
released, pointer, selections dropped, what clients with no process left behind freed (windows
and resources of ``RetainPermanent`` clients, found through X-Resource), root properties and
background, the baseline's top-level windows' properties and geometry (the panel's, the window
manager's), focus, and the server's settings that outlive their client (button and modifier
mappings, keyboard/pointer controls, screen saver, font path, access control: ``xmodmap``,
``xset``, ``xhost``; XKB controls and locks through :mod:`osfarm.desktop.x11.xkb`).

What is read here, and by the fingerprint (:mod:`osfarm.desktop.warm.fingerprint`), is read through
:mod:`osfarm.desktop.x11.x_read`.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Protocol

from Xlib import X
from Xlib import error as xerror
from Xlib.ext import xtest

from osfarm.desktop.x11.x_read import WM_MANAGED, geometry, raw_properties, x_connection, x_controls, x_orphans
from osfarm.desktop.x11.xkb import Xkb


class XBaseline(Protocol):
    """What :func:`x_reset` puts back: the X part of a warm reset's baseline
    (:class:`osfarm.desktop.warm.warm.Baseline`, recorded with :mod:`osfarm.desktop.x11.x_read`)."""

    root_properties: dict[str, tuple[int, int, Any]]
    window_properties: dict[int, dict[str, tuple[int, int, Any]]]  # the top-level windows'
    window_geometry: dict[int, tuple[int, int, int, int, int, bool]]
    pointer: tuple[int, int]
    controls: dict[str, Any]  # x_controls
    xkb: dict[str, Any]  # Xkb.read
    active: set[str]  # the WM-managed root properties set at the baseline


def _restore_properties(d: Any, w: Any, base: dict[str, tuple[int, int, Any]], skip: frozenset[str]) -> None:
    """Put ``w``'s properties back to ``base`` (added ones deleted, changed or deleted ones set)."""
    now = raw_properties(d, w)
    for name, (ptype, fmt, value) in now.items():
        if name in skip:
            continue
        if name not in base:
            w.delete_property(d.intern_atom(name))
        elif base[name] != (ptype, fmt, value):
            btype, bfmt, bvalue = base[name]
            w.change_property(d.intern_atom(name), btype, bfmt, bvalue)
    for name, (btype, bfmt, bvalue) in base.items():
        if name not in now and name not in skip:
            w.change_property(d.intern_atom(name), btype, bfmt, bvalue)


def _restore_geometry(w: Any, base: tuple[int, int, int, int, int, bool] | None) -> None:
    """A baseline window (the panel) moved, resized or (un)mapped by a client: put back."""
    if base is None:
        return
    now = geometry(w)
    if now[:5] != base[:5]:
        w.configure(x=base[0], y=base[1], width=base[2], height=base[3], border_width=base[4])
    if now[5] != base[5]:
        w.map() if base[5] else w.unmap()


def _kill_orphans(d: Any) -> None:
    """Free what :func:`x_orphans` found. KillClient names a client by one of its resources: its
    windows, anywhere in the tree (what other clients can see of an orphan is on a window; one
    with none left, only pixmaps or GCs, still counts in the fingerprint: a cold restart)."""
    orphans = x_orphans(d)
    if not orphans:
        return
    mask = d.res_query_clients().clients[0].resource_mask
    found: dict[int, int] = {}
    todo = [d.screen().root]
    while todo:
        w = todo.pop()
        with contextlib.suppress(Exception):
            for child in w.query_tree().children:
                todo.append(child)
                base = child.id & ~mask
                if base in orphans and base not in found:
                    found[base] = child.id
                    child.kill_client(onerror=xerror.CatchError())
    d.sync()


def _x_restore_controls(d: Any, base: dict[str, Any]) -> None:
    """Put :func:`x_controls` back to ``base`` (what differs only)."""
    now = x_controls(d)
    if not base or now == base:
        return
    if now["pointer_mapping"] != base["pointer_mapping"]:
        for _ in range(20):  # MappingBusy while a button is still down
            if d.set_pointer_mapping(base["pointer_mapping"]) == X.MappingSuccess:
                break
            time.sleep(0.005)
    if now["modifier_mapping"] != base["modifier_mapping"]:
        for _ in range(20):
            if d.set_modifier_mapping(base["modifier_mapping"]) == X.MappingSuccess:
                break
            time.sleep(0.005)
    if now["keyboard"] != base["keyboard"]:
        auto, leds, click, bell, pitch, duration, repeats = base["keyboard"]
        d.change_keyboard_control(key_click_percent=click, bell_percent=bell, bell_pitch=pitch,
                                  bell_duration=duration)
        for i in range(32):
            if (leds ^ now["keyboard"][1]) & (1 << i):
                d.change_keyboard_control(led=i + 1, led_mode=X.LedModeOn if leds & (1 << i) else X.LedModeOff)
        for i, (b, n) in enumerate(zip(repeats, now["keyboard"][6], strict=False)):
            for bit in range(8):
                if (b ^ n) & (1 << bit) and i * 8 + bit >= 8:
                    d.change_keyboard_control(key=i * 8 + bit, auto_repeat_mode=X.AutoRepeatModeOn
                                              if b & (1 << bit) else X.AutoRepeatModeOff)
        d.change_keyboard_control(auto_repeat_mode=X.AutoRepeatModeOn if auto else X.AutoRepeatModeOff)
    if now["pointer"] != base["pointer"]:
        num, den, threshold = base["pointer"]
        d.change_pointer_control(accel=(num, den), threshold=threshold)
    if now["screen_saver"] != base["screen_saver"]:
        d.set_screen_saver(*base["screen_saver"])
    if now["font_path"] != base["font_path"]:
        d.set_font_path(base["font_path"])
    if now["access"] != base["access"]:
        mode, hosts = base["access"]
        have = {json.dumps(h) for h in now["access"][1]}
        want = {json.dumps(h) for h in hosts}
        for h in have - want:
            family, name = json.loads(h)
            d.change_hosts(X.HostDelete, family, name)
        for h in want - have:
            family, name = json.loads(h)
            d.change_hosts(X.HostInsert, family, name)
        d.set_access_control(mode)


def x_reset(display: str, base: XBaseline, conn: Any = None) -> None:
    """Release keys and buttons, pointer back, selections dropped, what clients with no process
    left behind freed, root properties and the server's settings back to the baseline's."""
    with x_connection(display, conn) as d:
        root = d.screen().root
        keymap = d.query_keymap()
        for i, byte in enumerate(keymap):
            for b in range(8):
                if byte & (1 << b):
                    xtest.fake_input(d, X.KeyRelease, i * 8 + b)
        mask = root.query_pointer().mask
        for button, bit in ((1, X.Button1Mask), (2, X.Button2Mask), (3, X.Button3Mask), (4, X.Button4Mask),
                            (5, X.Button5Mask)):
            if mask & bit:
                xtest.fake_input(d, X.ButtonRelease, button)
        d.sync()
        for sel in ("PRIMARY", "SECONDARY", "CLIPBOARD"):
            atom = d.intern_atom(sel)
            if d.get_selection_owner(atom):
                d.set_selection_owner(atom, X.NONE, X.CurrentTime)
        # Clients whose process is gone (every agent process is): their windows and resources.
        # Not every new top-level window: one of the window manager's frames would take it along.
        _kill_orphans(d)
        d.sync()
        d.sync()
        Xkb.read(display, restore=base.xkb)
        _x_restore_controls(d, base.controls)
        d.force_screen_saver(X.ScreenSaverReset)
        _restore_properties(d, root, base.root_properties, WM_MANAGED)
        # the baseline's windows (the panel's, the window manager's): any client may set their
        # properties (a strut, a message for the next episode)
        for w in root.query_tree().children:
            if w.id in base.window_properties:
                with contextlib.suppress(Exception):  # a window that went away meanwhile
                    _restore_properties(d, w, base.window_properties[w.id], frozenset())
                    _restore_geometry(w, base.window_geometry.get(w.id))
        # the root's background (xsetroot; the guest's own wallpaper route refuses a warm reset):
        # the server's default, which the cold start has
        root.change_attributes(background_pixmap=X.NONE)
        root.clear_area(0, 0, 0, 0)
        xtest.fake_input(d, X.MotionNotify, x=base.pointer[0], y=base.pointer[1])
        if "_NET_ACTIVE_WINDOW" not in base.active:
            # nothing had the focus at the cold start: give it back to the root (the window
            # manager then clears its active window, as after a cold start)
            d.set_input_focus(X.PointerRoot, X.RevertToPointerRoot, X.CurrentTime)
            root.delete_property(d.intern_atom("_NET_ACTIVE_WINDOW"))
        d.sync()
