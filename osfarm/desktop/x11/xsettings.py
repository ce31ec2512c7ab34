"""The XSETTINGS manager's ``_XSETTINGS_SETTINGS`` property, read as settings.

GNOME's gsd-xsettings hands GTK apps the theme, fonts and text scale through this property. Its
bytes carry serial numbers that count the manager's updates since it started, and list the
settings in no fixed order, so the same settings differ byte for byte from one start to the next
(every warm reset of the GNOME desktop starts the daemon anew). The fingerprint compares what the
settings say instead (:func:`settings`).

Layout (the XSETTINGS specification): byte order (1), pad (3), serial (4), count (4), then per
setting: type (1: 0 integer, 1 string, 2 colour), pad (1), name length (2), name padded to 4,
last-change serial (4), value (integer: 4; string: length (4) and bytes padded to 4; colour: 4 x 2).
"""

from __future__ import annotations

import struct

from osfarm.errors import OsfarmError

INTEGER, STRING, COLOR = 0, 1, 2
# Settings whose value is new with each start of the session: the D-Bus session bus's id.
PER_START = frozenset({"Gtk/SessionBusId"})


class XSettingsError(OsfarmError, ValueError):
    """The property's bytes are not in the XSETTINGS layout."""


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def settings(blob: bytes) -> list[tuple[str, int | str | tuple[int, int, int, int]]]:
    """The settings in ``blob``, sorted by name, without serial numbers. Raises XSettingsError
    on a truncated or malformed blob (the manager is the agent's: its bytes are untrusted)."""
    if len(blob) < 12 or blob[0] not in (0, 1):
        raise XSettingsError("too short or unknown byte order")
    order = ">" if blob[0] == 1 else "<"  # 1: MSBFirst
    (count,) = struct.unpack_from(order + "I", blob, 8)
    out: list[tuple[str, int | str | tuple[int, int, int, int]]] = []
    pos = 12
    try:
        for _ in range(count):
            kind, name_len = blob[pos], struct.unpack_from(order + "H", blob, pos + 2)[0]
            pos += 4
            name = blob[pos:pos + name_len].decode("utf-8", "replace")
            pos += _pad4(name_len) + 4  # the name, then its last-change serial
            value: int | str | tuple[int, int, int, int]
            if kind == INTEGER:
                (value,) = struct.unpack_from(order + "i", blob, pos)
                pos += 4
            elif kind == STRING:
                (n,) = struct.unpack_from(order + "I", blob, pos)
                value = blob[pos + 4:pos + 4 + n].decode("utf-8", "replace")
                pos += 4 + _pad4(n)
            elif kind == COLOR:
                value = struct.unpack_from(order + "4H", blob, pos)
                pos += 8
            else:
                raise XSettingsError(f"unknown setting type {kind}")
            out.append((name, value))
    except (struct.error, IndexError) as e:
        raise XSettingsError(f"truncated: {e}") from None
    if pos > len(blob):
        raise XSettingsError("truncated")
    return sorted(out, key=lambda kv: kv[0])
