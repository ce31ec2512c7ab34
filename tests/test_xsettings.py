"""osfarm.desktop.x11.xsettings: the XSETTINGS property read as settings, serials left out."""

from __future__ import annotations

import struct

import pytest

from osfarm.desktop.x11.xsettings import XSettingsError, settings


def _blob(serial: int, entries: list[tuple[int, str, int, bytes]], order: str = "<") -> bytes:
    """Byte order, pad, serial, count, then (type, pad, name length, name padded, last-change, value)."""
    out = bytes([0 if order == "<" else 1, 0, 0, 0]) + struct.pack(order + "II", serial, len(entries))
    for kind, name, changed, value in entries:
        raw = name.encode()
        out += bytes([kind, 0]) + struct.pack(order + "H", len(raw)) + raw + b"\0" * (-len(raw) % 4)
        out += struct.pack(order + "I", changed) + value
    return out


def _string(text: str, order: str = "<") -> bytes:
    raw = text.encode()
    return struct.pack(order + "I", len(raw)) + raw + b"\0" * (-len(raw) % 4)


def test_same_settings_in_another_order_with_other_serials_read_the_same() -> None:
    a = _blob(1, [(1, "Net/ThemeName", 0, _string("Yaru")), (0, "Xft/DPI", 0, struct.pack("<i", 98304)),
                  (2, "Gtk/Color", 0, struct.pack("<4H", 1, 2, 3, 65535))])
    b = _blob(7, [(0, "Xft/DPI", 5, struct.pack("<i", 98304)), (2, "Gtk/Color", 3, struct.pack("<4H", 1, 2, 3, 65535)),
                  (1, "Net/ThemeName", 9, _string("Yaru"))])
    assert a != b
    want = [("Gtk/Color", (1, 2, 3, 65535)), ("Net/ThemeName", "Yaru"), ("Xft/DPI", 98304)]
    assert settings(a) == settings(b) == want


def test_big_endian_and_negative_integers() -> None:
    blob = _blob(2, [(0, "Gtk/CursorBlinkTime", 0, struct.pack(">i", -1)), (1, "Gtk/FontName", 0,
                 _string("Ubuntu 11", ">"))], order=">")
    assert settings(blob) == [("Gtk/CursorBlinkTime", -1), ("Gtk/FontName", "Ubuntu 11")]


@pytest.mark.parametrize("blob", [
    b"", b"\x05" + b"\0" * 11,  # too short; unknown byte order
    _blob(1, [(1, "Net/ThemeName", 0, _string("Yaru"))])[:-4],  # the string cut short
    _blob(1, [(9, "Odd", 0, b"\0\0\0\0")]),  # unknown type
    b"\0\0\0\0" + struct.pack("<II", 1, 3),  # says 3 settings, holds none
])
def test_malformed_blobs_are_refused(blob: bytes) -> None:
    with pytest.raises(XSettingsError):
        settings(blob)
