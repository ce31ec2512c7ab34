"""Switching the desktop's accessibility on: the environment that turns it on in apps, the
runtime dir the AT-SPI bus launcher gets in a box, and, once the launcher runs, the bus's
IsEnabled switch and the registry daemon (at-spi2-registryd) started ahead of the first app.

Used by :class:`osfarm.desktop.session.session.Session` at a cold start and after a warm reset. Standard
library only at import, like the session (``gi`` is optional and imported where it is used).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from osfarm.desktop.session.a11y_bus import open_connection

log = logging.getLogger(__name__)

# Environment every app of the desktop gets (accessibility on for GTK, Qt and LibreOffice).
A11Y_ENV = {
    "GTK_MODULES": "gail:atk-bridge",
    "QT_ACCESSIBILITY": "1",
    "QT_LINUX_ACCESSIBILITY_ALWAYS_ON": "1",
    "SAL_USE_VCLPLUGIN": "gtk3",
    "NO_AT_BRIDGE": "0",
}


def launcher_runtime_dir() -> str:
    """A new dir in /tmp for the bus launcher's ``XDG_RUNTIME_DIR``, with its ``at-spi/`` made
    beforehand, sticky and open to all (the session's ``_spawn`` says why)."""
    base = Path(tempfile.mkdtemp(prefix="osfarm-a11y-"))
    base.chmod(0o1777)  # the launcher's dconf writes here too
    (base / "at-spi").mkdir(mode=0o1777)
    (base / "at-spi").chmod(0o1777)
    return str(base)


def _use_bus_address(env: dict[str, str], address: str) -> None:
    # Apps launched from now on get the bus directly instead of reading it from the X root
    # window, which any client of this display may overwrite.
    env["AT_SPI_BUS_ADDRESS"] = address
    os.environ["AT_SPI_BUS_ADDRESS"] = address


def enable_gio(dbus_address: str, env: dict[str, str], mark: Callable[[str], None],
               stop: Callable[[], bool], timeout: float = 10.0) -> bool:
    """What :func:`enable_dbus_send` does, with in-process D-Bus calls (Gio) instead of a
    ``dbus-send`` process each (a warm reset waits for them); False where gi is missing (nothing
    done then). ``mark`` is called with ``a11y_bus`` and ``registry`` as each step is done."""
    try:
        from gi.repository import Gio, GLib
    except ImportError:
        return False
    deadline = time.monotonic() + timeout

    def call(conn: Any, dest: str, path: str, iface: str, method: str, args: Any, reply: str | None) -> Any:
        left = max(1, int((deadline - time.monotonic()) * 1000))
        return conn.call_sync(dest, path, iface, method, args, GLib.VariantType(reply) if reply else None,
                              Gio.DBusCallFlags.NONE, left, None).unpack()

    bus = ("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus")
    conns = []
    try:
        conn = open_connection(dbus_address, 2000)
        conns.append(conn)
        while not call(conn, *bus, "NameHasOwner", GLib.Variant("(s)", ("org.a11y.Bus",)), "(b)")[0]:
            if time.monotonic() > deadline or stop():
                log.warning("AT-SPI bus did not come up; /accessibility will be empty")
                return True
            time.sleep(0.002)
        mark("a11y_bus")
        call(conn, "org.a11y.Bus", "/org/a11y/bus", "org.freedesktop.DBus.Properties", "Set",
             GLib.Variant("(ssv)", ("org.a11y.Status", "IsEnabled", GLib.Variant("b", True))), None)
        address = call(conn, "org.a11y.Bus", "/org/a11y/bus", "org.a11y.Bus", "GetAddress", None, "(s)")[0]
        if not address:
            return True
        _use_bus_address(env, address)
        a11y = open_connection(address, 2000)
        conns.append(a11y)
        call(a11y, *bus, "StartServiceByName", GLib.Variant("(su)", ("org.a11y.atspi.Registry", 0)), "(u)")
    except GLib.Error as e:
        log.warning("enabling AT-SPI failed: %s", e.message)
        return True
    finally:
        for c in conns:
            with contextlib.suppress(Exception):
                c.close_sync(None)
    mark("registry")
    return True


def enable_dbus_send(env: dict[str, str], stop: Callable[[], bool], poll_s: float = 0.05) -> bool:
    """Set org.a11y.Status.IsEnabled once the bus launcher owns its name, then start the
    registry (:func:`start_registry`); True once done, False if the bus did not come up in 10 s
    or ``stop`` said to give up.

    ``--a11y=1`` already asks for it; setting the property too covers launcher versions
    that ignore the flag, and GTK apps started later read it at startup.
    """
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not stop():
        r = subprocess.run(
            ["dbus-send", "--session", "--print-reply", "--dest=org.freedesktop.DBus",
             "/org/freedesktop/DBus", "org.freedesktop.DBus.NameHasOwner", "string:org.a11y.Bus"],
            capture_output=True, text=True, env=env,
        )
        if "boolean true" in r.stdout:
            subprocess.run(
                ["dbus-send", "--session", "--print-reply", "--dest=org.a11y.Bus", "/org/a11y/bus",
                 "org.freedesktop.DBus.Properties.Set", "string:org.a11y.Status",
                 "string:IsEnabled", "variant:boolean:true"],
                capture_output=True, env=env,
            )
            start_registry(env)
            return True
        time.sleep(poll_s)
    if not stop():
        log.warning("AT-SPI bus did not come up; /accessibility will be empty")
    return False


def start_registry(env: dict[str, str]) -> None:
    """Start at-spi2-registryd now (it is D-Bus-activated on the a11y bus, normally by the
    first app), so the bus answers health checks and the first tree request is not slowed."""
    r = subprocess.run(
        ["dbus-send", "--session", "--print-reply=literal", "--dest=org.a11y.Bus", "/org/a11y/bus",
         "org.a11y.Bus.GetAddress"], capture_output=True, text=True, env=env,
    )
    address = r.stdout.strip()
    if r.returncode != 0 or not address:
        return
    _use_bus_address(env, address)
    subprocess.run(
        ["dbus-send", f"--bus={address}", "--print-reply", "--dest=org.freedesktop.DBus",
         "/org/freedesktop/DBus", "org.freedesktop.DBus.StartServiceByName",
         "string:org.a11y.atspi.Registry", "uint32:0"], capture_output=True, env=env,
    )
