"""Talking to the AT-SPI (accessibility) bus over D-Bus, every call bounded by a timeout.

Used by :mod:`osfarm.desktop.session.a11y` (the tree) and by the guest's health check. Plain D-Bus calls
(Gio) on private connections, instead of libatspi/pyatspi: libatspi blocked without bound in our
tests (its first contact with an app waits D-Bus's default 25 s when the app is hung, and a
peer-to-peer connection to a LibreOffice busy starting up stalled for minutes), it aborts the
whole process (g_error) when the bus is missing, and its cache goes stale in a process without a
GLib main loop.

The a11y bus address is looked up through the session bus in ``DBUS_SESSION_BUS_ADDRESS`` on
each call, so one process serves the session in its environment. Blocking calls, meant for
worker threads. ``gi`` (PyGObject, a system package) is imported inside the functions that need
it: it is optional, and the guest must start without it.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gi.repository import Gio, GLib

__all__ = [
    "AppGone", "Bus", "Ref", "get_bus", "is_gone", "variant", "a11y_bus_address", "a11y_bus_ok",
    "set_a11y_enabled",
]

# Per-D-Bus-call timeout. A healthy app answers in well under a millisecond; a busy one (Calc
# loading a file) may take a while, a hung one never answers.
CALL_TIMEOUT_MS = 1500

ACCESSIBLE = "org.a11y.atspi.Accessible"
PROPERTIES = "org.freedesktop.DBus.Properties"
REGISTRY = "org.a11y.atspi.Registry"
ROOT_PATH = "/org/a11y/atspi/accessible/root"
NULL_PATH = "/org/a11y/atspi/null"


class AppGone(Exception):
    """The application stopped answering (timeout / vanished): stop walking it."""


class Bus:
    """A private connection to the a11y bus; every call has a hard timeout (module doc)."""

    def __init__(self, address: str) -> None:
        from gi.repository import Gio

        self.address = address
        self.conn = open_connection(address, 1000)
        self._Gio = Gio

    def call(self, dest: str, path: str, iface: str, method: str, args: GLib.Variant | None = None,
             reply: str | None = None, timeout_ms: int = CALL_TIMEOUT_MS) -> Any:
        from gi.repository import GLib

        try:
            result = self.conn.call_sync(
                dest, path, iface, method, args, GLib.VariantType(reply) if reply else None,
                self._Gio.DBusCallFlags.NONE, timeout_ms, None,
            )
        except GLib.Error as err:
            if is_gone(err):
                raise AppGone(err.message) from err
            raise
        return result.unpack()

    def close(self) -> None:
        try:
            self.conn.close_sync(None)
        except Exception:
            pass


_bus: Bus | None = None


def get_bus() -> Bus:
    """The cached a11y bus connection, (re)opened when closed or the session's address changed.

    Not thread-safe: callers serialize (:mod:`osfarm.desktop.session.a11y` holds its lock).
    """
    global _bus
    address = _a11y_bus_address()
    if _bus is None or _bus.conn.is_closed() or _bus.address != address:
        if _bus is not None:
            _bus.close()
        _bus = Bus(address)
    return _bus


def is_gone(err: GLib.Error) -> bool:
    """Whether an error means the whole *application* is gone or hung (not just one object:
    objects vanish all the time, e.g. a closed menu's items, and that must not cut off the app)."""
    from gi.repository import Gio

    if getattr(err, "domain", "") == "g-io-error-quark" and err.code in (
        Gio.IOErrorEnum.TIMED_OUT, Gio.IOErrorEnum.CLOSED, Gio.IOErrorEnum.CANCELLED,
    ):
        return True
    msg = str(getattr(err, "message", err)).lower()
    return any(s in msg for s in (
        "timeout", "timed out", "noreply", "no reply", "disconnected", "serviceunknown",
        "was not provided by any", "name has no owner", "connection is closed",
    ))


class Ref:
    """One accessible object: (bus name, object path), plus the bus to call it on."""

    __slots__ = ("bus", "name", "path")

    def __init__(self, bus: Bus, name: str, path: str) -> None:
        self.bus, self.name, self.path = bus, name, path

    def call(self, iface: str, method: str, args: GLib.Variant | None = None, reply: str | None = None,
             timeout_ms: int = CALL_TIMEOUT_MS) -> Any:
        return self.bus.call(self.name, self.path, "org.a11y.atspi." + iface if "." not in iface else iface,
                             method, args, reply, timeout_ms)

    def ref(self, so: tuple[str, str]) -> Ref | None:
        name, path = so
        if not name or path == NULL_PATH:
            return None
        return Ref(self.bus, name, path)


def variant(fmt: str, *values: Any) -> GLib.Variant:
    from gi.repository import GLib

    return GLib.Variant(fmt, values)


def open_connection(address: str, timeout_ms: int) -> Gio.DBusConnection:
    """Connect to a bus; the connect+auth handshake is bounded by a cancellable timer."""
    from gi.repository import Gio

    cancel = Gio.Cancellable()
    timer = threading.Timer(timeout_ms / 1000.0, cancel.cancel)
    timer.start()
    try:
        return Gio.DBusConnection.new_for_address_sync(
            address,
            Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION,
            None, cancel,
        )
    finally:
        timer.cancel()


def _session_call(
    method: str, params: GLib.Variant | None, reply_type: str | None, timeout_ms: int, path: str = "/org/a11y/bus",
    iface: str = "org.a11y.Bus", dest: str = "org.a11y.Bus", address: str | None = None,
) -> GLib.Variant:
    from gi.repository import Gio, GLib

    # A private connection each time (not Gio's process-wide session singleton), so the
    # address in the environment *now* is the one used.
    if address is None:
        address = os.environ.get("DBUS_SESSION_BUS_ADDRESS", "")
    if not address:
        raise RuntimeError("DBUS_SESSION_BUS_ADDRESS is not set")
    conn = open_connection(address, timeout_ms)
    try:
        return conn.call_sync(
            dest, path, iface, method, params,
            GLib.VariantType(reply_type) if reply_type else None,
            # at-spi2-registryd is D-Bus-activated on the a11y bus: let it start; but never
            # auto-start a whole a11y bus launcher from a mere check.
            Gio.DBusCallFlags.NO_AUTO_START if dest == "org.a11y.Bus" else Gio.DBusCallFlags.NONE,
            timeout_ms, None,
        )
    finally:
        conn.close_sync(None)


def _registry_answers(address: str, timeout_ms: int = 400) -> bool:
    from gi.repository import GLib

    try:
        _session_call(
            "Get", GLib.Variant("(ss)", (ACCESSIBLE, "ChildCount")), "(v)",
            timeout_ms, path=ROOT_PATH, iface=PROPERTIES, dest=REGISTRY, address=address,
        )
        return True
    except Exception:
        return False


def _a11y_bus_address(timeout_ms: int = 400) -> str:
    """The a11y bus address from the session's ``org.a11y.Bus``, checked to answer; raises."""
    address = _session_call("GetAddress", None, "(s)", timeout_ms).unpack()[0]
    if not _registry_answers(address, timeout_ms):
        raise RuntimeError(f"AT-SPI registry does not answer on {address}")
    return address


def a11y_bus_address() -> str | None:
    """The session's a11y bus address (from ``org.a11y.Bus.GetAddress``) if its registry answers.

    The session launcher should export it as ``AT_SPI_BUS_ADDRESS`` to every app: libatspi and
    the ATK bridge otherwise take the address from the X root window's ``AT_SPI_BUS`` property
    first, which any process pointed at the same display can overwrite.
    """
    try:
        return _a11y_bus_address()
    except Exception:
        return None


def a11y_bus_ok() -> bool:
    """True when the a11y bus is up and the AT-SPI registry answers; returns within ~1 s."""
    try:
        _a11y_bus_address()
        return True
    except Exception:
        return False


def set_a11y_enabled(enabled: bool = True) -> bool:
    """Set ``org.a11y.Status.IsEnabled`` on the session's a11y bus launcher (see :mod:`osfarm.desktop.session.a11y`).

    Apps read it when they start (Chromium exposes nothing without it). Returns success.
    """
    try:
        from gi.repository import GLib

        _session_call(
            "Set",
            GLib.Variant("(ssv)", ("org.a11y.Status", "IsEnabled", GLib.Variant("b", enabled))),
            None, 1000, iface=PROPERTIES,
        )
        return True
    except Exception:
        return False
