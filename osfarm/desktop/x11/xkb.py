"""The X server's XKB controls and locks, read and put back through libX11 (ctypes): python-xlib
has no XKB. Part of the fingerprint's X state; a warm reset puts them back."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any


class Xkb:
    """The XKB state python-xlib cannot reach, through libX11 (ctypes): the enabled controls and
    their parameters (StickyKeys, SlowKeys, BounceKeys, MouseKeys, repeat rate ...: ``XkbControlsRec``)
    and the locked and latched modifiers and group (Caps Lock, Num Lock). An agent's SlowKeys
    would swallow the next episode's typing, a Caps Lock left on would change it."""

    USE_CORE_KBD = 0x100
    ALL_CONTROLS = 0xF8001FFF  # XkbAllControlsMask
    CONTROLS_SIZE = 84  # sizeof(XkbControlsRec)

    class Desc(ctypes.Structure):  # the head of XkbDescRec
        _fields_ = [("dpy", ctypes.c_void_p), ("flags", ctypes.c_ushort), ("device_spec", ctypes.c_ushort),
                    ("min_key_code", ctypes.c_ubyte), ("max_key_code", ctypes.c_ubyte), ("ctrls", ctypes.c_void_p)]

    class State(ctypes.Structure):  # XkbStateRec
        _fields_ = [("group", ctypes.c_ubyte), ("locked_group", ctypes.c_ubyte), ("base_group", ctypes.c_ushort),
                    ("latched_group", ctypes.c_ushort), ("mods", ctypes.c_ubyte), ("base_mods", ctypes.c_ubyte),
                    ("latched_mods", ctypes.c_ubyte), ("locked_mods", ctypes.c_ubyte), ("compat_state", ctypes.c_ubyte),
                    ("grab_mods", ctypes.c_ubyte), ("compat_grab_mods", ctypes.c_ubyte),
                    ("lookup_mods", ctypes.c_ubyte), ("compat_lookup_mods", ctypes.c_ubyte),
                    ("ptr_buttons", ctypes.c_ushort)]

    _lib: Any = None
    # libX11's default error handler exits the process: this one ignores (the answer read after says)
    _on_error = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda dpy, ev: 0)

    @classmethod
    def lib(cls) -> Any:
        if cls._lib is None:
            x = ctypes.CDLL(ctypes.util.find_library("X11") or "libX11.so.6")
            x.XOpenDisplay.restype = ctypes.c_void_p
            x.XOpenDisplay.argtypes = [ctypes.c_char_p]
            x.XCloseDisplay.argtypes = [ctypes.c_void_p]
            x.XSync.argtypes = [ctypes.c_void_p, ctypes.c_int]
            x.XkbAllocKeyboard.restype = ctypes.POINTER(cls.Desc)
            x.XkbFreeKeyboard.argtypes = [ctypes.POINTER(cls.Desc), ctypes.c_uint, ctypes.c_int]
            x.XkbGetControls.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(cls.Desc)]
            x.XkbSetControls.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(cls.Desc)]
            x.XkbGetState.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(cls.State)]
            for f in ("XkbLockModifiers", "XkbLatchModifiers"):
                getattr(x, f).argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]
            for f in ("XkbLockGroup", "XkbLatchGroup"):
                getattr(x, f).argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            x.XSetErrorHandler.argtypes = [ctypes.c_void_p]
            x.XSetErrorHandler(ctypes.cast(cls._on_error, ctypes.c_void_p))
            cls._lib = x
        return cls._lib

    @classmethod
    def read(cls, display: str, restore: dict[str, Any] | None = None) -> dict[str, Any]:
        """``{"controls": hex, "state": [...]}``; with ``restore`` (an earlier answer), put that back
        first (what differs only). ``{}`` where libX11 or XKB is missing."""
        try:
            x = cls.lib()
        except OSError:
            return {}
        dpy = x.XOpenDisplay(display.encode())
        if not dpy:
            return {}
        desc = x.XkbAllocKeyboard()
        try:
            if not desc:
                return {}
            desc.contents.device_spec = cls.USE_CORE_KBD
            out = cls._get(x, dpy, desc)
            if restore and out != restore:
                if out["controls"] != restore["controls"]:
                    ctypes.memmove(desc.contents.ctrls, bytes.fromhex(restore["controls"]), cls.CONTROLS_SIZE)
                    x.XkbSetControls(dpy, cls.ALL_CONTROLS, desc)
                locked_mods, latched_mods, locked_group, latched_group = restore["state"]
                x.XkbLockModifiers(dpy, cls.USE_CORE_KBD, 0xFF, locked_mods)
                x.XkbLatchModifiers(dpy, cls.USE_CORE_KBD, 0xFF, latched_mods)
                x.XkbLockGroup(dpy, cls.USE_CORE_KBD, locked_group)
                x.XkbLatchGroup(dpy, cls.USE_CORE_KBD, latched_group)
                x.XSync(dpy, 0)
                out = cls._get(x, dpy, desc)
            return out
        finally:
            if desc:
                x.XkbFreeKeyboard(desc, 0, 1)
            x.XCloseDisplay(dpy)

    @classmethod
    def _get(cls, x: Any, dpy: int, desc: Any) -> dict[str, Any]:
        if x.XkbGetControls(dpy, cls.ALL_CONTROLS, desc) != 0 or not desc.contents.ctrls:
            return {}
        st = cls.State()
        x.XkbGetState(dpy, cls.USE_CORE_KBD, ctypes.byref(st))
        return {"controls": ctypes.string_at(desc.contents.ctrls, cls.CONTROLS_SIZE).hex(),
                "state": [st.locked_mods, st.latched_mods, st.locked_group, st.latched_group]}
