"""EWMH reads on a caller's python-xlib connection: the managed windows, their titles, a window's
rectangle. No pydantic here: ``osfarm-settle`` polls :func:`client_geometry` in a short-lived
process that must not pay for the guest's models (:mod:`osfarm.desktop.x11.windows` builds on these).
"""

from __future__ import annotations

from Xlib import X, Xatom
from Xlib import display as xdisplay
from Xlib.error import XError


def atom(d: xdisplay.Display, name: str) -> int:
    return d.intern_atom(name)


def client_ids(d: xdisplay.Display) -> list[int]:
    root = d.screen().root
    prop = root.get_full_property(atom(d, "_NET_CLIENT_LIST"), Xatom.WINDOW)
    if prop is not None and prop.value is not None:
        return [int(w) for w in prop.value]
    # No EWMH window manager: the root's mapped children are the top-level windows.
    ids = []
    for child in root.query_tree().children:
        try:
            attrs = child.get_attributes()
            if attrs.map_state == X.IsViewable and not attrs.override_redirect:
                ids.append(child.id)
        except XError:
            continue
    return ids


def window_title(d: xdisplay.Display, win) -> str:  # noqa: ANN001 - Xlib window resource
    prop = win.get_full_property(atom(d, "_NET_WM_NAME"), atom(d, "UTF8_STRING"))
    if prop is not None and prop.value:
        v = prop.value
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
    prop = win.get_full_property(Xatom.WM_NAME, X.AnyPropertyType)
    if prop is None or not prop.value:
        return ""
    v = prop.value
    return v.decode("latin-1") if isinstance(v, bytes) else str(v)


def client_geometry(d: xdisplay.Display, title_part: str) -> tuple[int, int, int, int] | None:
    """(x, y, width, height) in root coordinates of the first managed window whose title contains
    ``title_part`` (case-sensitive, like ``wmctrl -lG | grep``), on the caller's connection ``d``."""
    root = d.screen().root
    for wid in client_ids(d):
        win = d.create_resource_object("window", wid)
        try:
            if title_part not in window_title(d, win):
                continue
            geom = win.get_geometry()
            pos = root.translate_coords(win, 0, 0)
        except XError:
            continue  # the window went away while we looked at it
        if geom.width > 0 and geom.height > 0:
            return pos.x, pos.y, geom.width, geom.height
    return None
