"""Reading the X server's state: root and window properties, atom names, window geometry, the
server's settings that outlive their client, and the clients with no process left. A warm reset
records its baseline with these and puts it back with them (:mod:`osfarm.desktop.warm.warm`,
:mod:`osfarm.desktop.warm.x_reset`); the fingerprint reads the same state the same way
(:mod:`osfarm.desktop.warm.fingerprint`). It imports nothing of osfarm: the three read X through it,
not through each other.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from Xlib import X
from Xlib import display as xdisplay
from Xlib.ext import res

# Root window properties the window manager keeps up to date itself.
WM_MANAGED = frozenset({"_NET_CLIENT_LIST", "_NET_CLIENT_LIST_STACKING", "_NET_ACTIVE_WINDOW"})


# Atom names by (display, atom): an atom keeps its name for the X server's life, which in a box is
# the guest's (cleared when a baseline is taken). Saves a round trip per property and type.
_atom_names: dict[tuple[str, int], str] = {}


def atom_name(d: Any, atom: int) -> str:
    key = (d.get_display_name(), atom)
    name = _atom_names.get(key)
    if name is None:
        name = _atom_names[key] = d.get_atom_name(atom)
    return name


def forget_atom_names() -> None:
    """Drop the cached names (:func:`osfarm.desktop.warm.warm.take_baseline` does, before it records)."""
    _atom_names.clear()


@contextlib.contextmanager
def x_connection(display: str, d: Any = None) -> Any:
    """``d`` where the caller has a connection open, else a new one, closed afterwards."""
    if d is not None:
        yield d
        return
    d = xdisplay.Display(display)
    try:
        yield d
    finally:
        d.close()


def geometry(w: Any) -> tuple[int, int, int, int, int, bool]:
    g = w.get_geometry()
    return (g.x, g.y, g.width, g.height, g.border_width, w.get_attributes().map_state != X.IsUnmapped)


def raw_properties(d: Any, window: Any = None) -> dict[str, tuple[int, int, Any]]:
    """The properties of the root window (or of ``window``): name -> (type, format, value)."""
    root = d.screen().root if window is None else window
    out = {}
    for atom in root.list_properties():
        p = root.get_full_property(atom, X.AnyPropertyType)
        if p is not None:
            out[atom_name(d, atom)] = (p.property_type, p.format, p.value)
    return out


def x_controls(d: Any) -> dict[str, Any]:
    """The X server's settings a client can change and that outlive it (``xmodmap``, ``xset``,
    ``xhost``): button and modifier mappings, keyboard and pointer controls, screen saver, font
    path, access control. A next episode's clicks, shortcuts and screenshots depend on them."""
    kbd = d.get_keyboard_control()
    ptr = d.get_pointer_control()
    saver = d.get_screen_saver()
    hosts = d.list_hosts()
    return {
        "pointer_mapping": list(d.get_pointer_mapping()),
        "modifier_mapping": [list(m) for m in d.get_modifier_mapping()],
        "keyboard": [kbd.global_auto_repeat, kbd.led_mask, kbd.key_click_percent, kbd.bell_percent,
                     kbd.bell_pitch, kbd.bell_duration, list(kbd.auto_repeats)],
        "pointer": [ptr.accel_num, ptr.accel_denom, ptr.threshold],
        "screen_saver": [saver.timeout, saver.interval, saver.prefer_blanking, saver.allow_exposures],
        "font_path": list(d.get_font_path()),
        "access": [hosts.mode, sorted([h.family, list(h.name)] for h in hosts.hosts)],
    }


def x_orphans(d: Any) -> list[int]:
    """The X clients with no process behind them, by resource base: what a client left past its
    connection with ``XSetCloseDownMode(RetainPermanent)`` (windows inside other clients' windows,
    selections, properties that no window list shows). The server's own (base 0) is not one."""
    try:
        clients = d.res_query_clients().clients
        ids = d.res_query_client_ids([{"client": c.resource_base, "mask": res.LocalClientPIDMask}
                                      for c in clients if c.resource_base])
    except Exception:  # noqa: BLE001 - no X-Resource extension: nothing to say
        return []
    pids = {i.spec.client: (i.value[0] if i.value else -1) for i in ids.ids}
    return sorted(c.resource_base for c in clients
                  if c.resource_base and not (pids.get(c.resource_base, -1) > 0
                                              and os.path.exists(f"/proc/{pids[c.resource_base]}")))
