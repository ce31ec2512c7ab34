"""The GNOME desktop (``--desktop gnome``): the screen OSWorld's Ubuntu 22.04 VM shows.

GNOME Shell runs as an X11 compositor on the desktop's Xvfb (software rendering), in Ubuntu's
session mode (``assets/gnome/share/gnome-shell/modes/ubuntu.json``: the Yaru shell theme and
dash-to-dock as the Ubuntu Dock), with Ubuntu's settings as a dconf system database under the
user's (``assets/gnome/dconf/ubuntu-defaults``, compiled by :func:`compile_defaults` into the
box's ``/etc/dconf``): the dock on the left, always shown, OSWorld's favourites, Yaru, the Ubuntu
font, animations off. Beside it: ``gsd-xsettings`` (GTK apps get the theme, fonts and text
scaling from it, as under gnome-session), ``gsd-media-keys`` (Ctrl+Alt+T opens the terminal) and
``gsd-a11y-settings``.

Everything here runs in the agent's world, as on Ubuntu, where the shell is the user's own
process: the shell launches the apps of the dock and the overview, which must be the agent's
(:mod:`osfarm.desktop.box.agent_world`). The box's system bus runs as the agent's root (it can do
no more than the agent's ``sudo``) with one activatable service, ``systemd-timedated``, so that
``timedatectl`` works without systemd; ``/run/systemd/system`` says "booted with systemd" to
timedatectl, and ``/run/systemd/seats`` stays absent, so the shell uses its login manager for
systems without logind. A warm reset kills all of it with the agent's other processes and starts
it again (:meth:`osfarm.desktop.session.session.Session.restart_agent_buses`).

Standard library only (the launcher imports it before the server stack); the X root window is
read with ``xprop``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from osfarm.errors import OsfarmError

GNOME = Path(__file__).resolve().parent.parent / "assets" / "gnome"
DESKTOPS = ("gnome", "light")
SHELL = "gnome-shell"
# dconf-service too: D-Bus would start it on the first settings write, at a moment that differs
# from one start to the next (and a warm reset's process list would not be the cold start's)
SETTINGS_DAEMONS = ("gsd-xsettings", "gsd-media-keys", "gsd-a11y-settings", "dconf-service")
GSD_DIR = "/usr/libexec"
SYSTEM_BUS_SOCKET = "/run/dbus/system_bus_socket"
LOCALE = "en_US.UTF-8"
# The name of the dconf system database the defaults are compiled into (/etc/dconf/db/<name>).
DCONF_DB = "osfarm-ubuntu"
DCONF_PROFILE = f"user-db:user\nsystem-db:{DCONF_DB}\n"


# What Ubuntu's defaults.list gives on top of the light desktop's choices: gedit for text, eog for
# images (merged over home_settings.DEFAULT_APPS).
DEFAULT_APPS = {
    "text/plain": "org.gnome.gedit.desktop",
    **{f"image/{t}": "org.gnome.eog.desktop" for t in ("png", "jpeg", "gif", "bmp", "tiff", "webp", "svg+xml",
                                                        "x-icon", "x-portable-pixmap")},
}
HOME_FILES = {
    # The shell warns once per home, in a banner at the top of the screen, that it cannot lock
    # without GDM; this file is its "already warned". OSWorld's VM runs GDM and never shows it.
    ".local/share/gnome-shell/lock-warning-shown": "",
}


# Session services the bus starts on demand and that quit when idle (GIO's metadata daemon; the
# shell's screencast service, with its hidden window, and the zombie it leaves for a moment):
# whether one runs when a fingerprint is taken is timing, not state a task left, so the
# fingerprint leaves them out. The agent cannot hide behind these names: a warm reset kills every
# agent process before its fingerprint, so what runs then was started by the session anew.
ON_DEMAND_PROCESSES = frozenset({
    "/usr/libexec/gvfsd-metadata", "[gvfsd-metadata]",
    "/usr/bin/gjs /usr/share/gnome-shell/org.gnome.Shell.Screencast", "[gjs]",
})
ON_DEMAND_WINDOW_CLASSES = frozenset({"org.gnome.Shell.Screencast"})


# How long the guest waits for the shell's top bar and dock before it answers anyway: about 3 s on a
# sandbox, over a minute in a VM under TCG emulation (answering earlier starts the task on a black
# screen). A farm's start timeout (60 s by default; 900 s for a TCG VM) ends a start that takes longer.
SHELL_READY_S = 300.0

# The session's shell watcher (osfarm.desktop.session.session.Session._watch_shell): how often it looks,
# and the window in which recent restarts count towards its back-off.
SHELL_WATCH_S = 0.5
SHELL_RESPAWN_WINDOW_S = 300.0
SHELL_RESPAWN_MAX_WAIT_S = 30.0


def shell_respawn_wait_s(recent_restarts: int) -> float:
    """How long after the last restart the shell may be started again, given how many restarts
    the last ``SHELL_RESPAWN_WINDOW_S`` saw: at once the first time, then 1, 2, 4 ... s, at most
    ``SHELL_RESPAWN_MAX_WAIT_S`` (a shell that dies at every start costs a start per 30 s)."""
    if recent_restarts <= 0:
        return 0.0
    return min(SHELL_RESPAWN_MAX_WAIT_S, 2.0 ** (recent_restarts - 1))


class GnomeMissing(OsfarmError, RuntimeError):
    """GNOME Shell or one of its parts is not installed where the desktop runs."""


def session_env(base: dict[str, str]) -> dict[str, str]:
    """The variables of an Ubuntu GNOME login on X11, over ``base`` (every process of the desktop
    gets them: apps started by a task's setup see the same desktop as those started from the dock)."""
    env = dict(base)
    env.update(
        XDG_CURRENT_DESKTOP="ubuntu:GNOME", XDG_SESSION_DESKTOP="ubuntu", DESKTOP_SESSION="ubuntu",
        GNOME_SHELL_SESSION_MODE="ubuntu", XDG_SESSION_TYPE="x11", XDG_SESSION_CLASS="user",
        # our session mode and the desktop entries OSWorld's tasks name (google-chrome, code) first
        XDG_DATA_DIRS=f"{GNOME / 'share'}:/usr/local/share:/usr/share",
        XDG_CONFIG_DIRS="/etc/xdg",
        DBUS_SYSTEM_BUS_ADDRESS=f"unix:path={SYSTEM_BUS_SOCKET}",
        # software rendering's shader cache would be written in the home at times that differ
        # from one start to the next: a warm reset could never come back to the cold start's files
        MESA_SHADER_CACHE_DISABLE="true",
    )  # fmt: skip
    if locale_available(LOCALE):
        env.update(LANG=LOCALE, LANGUAGE="en_US:en")
        env.pop("LC_ALL", None)
    return env


def locale_available(name: str) -> bool:
    """Whether glibc has ``name`` (e.g. en_US.UTF-8) in its locale archive or as a locale dir."""
    want = name.lower().replace("utf-8", "utf8")
    for d in ("/usr/lib/locale",):
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        if any(e.lower().replace("utf-8", "utf8") == want for e in entries):
            return True
        if "locale-archive" in entries:
            try:
                out = subprocess.run(["locale", "-a"], capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.TimeoutExpired):
                return False
            return any(ln.strip().lower() == want for ln in out.splitlines())
    return False


def missing_parts() -> list[str]:
    """What GNOME needs that is not installed here (empty: all there)."""
    need = [shutil.which(SHELL) or SHELL, shutil.which("xprop") or "xprop", "/usr/bin/dbus-daemon",
            "/lib/systemd/systemd-timedated",
            "/usr/share/gnome-shell/extensions/dash-to-dock@micxgx.gmail.com",
            "/usr/share/gnome-shell/theme/Yaru/gnome-shell.css"]
    need += [f"{GSD_DIR}/{d}" for d in SETTINGS_DAEMONS]
    return [p for p in need if not os.path.exists(p)]


def system_bus_command(dbus_daemon: str = "/usr/bin/dbus-daemon") -> list[str]:
    """The box's system bus, as the agent's root: its dirs in the agent's own /run first."""
    config = GNOME / "dbus-system.conf"
    return ["/bin/sh", "-c",
            f"mkdir -p /run/dbus /run/systemd/system && exec {dbus_daemon} --config-file={config} --nofork --nopidfile"]


def shell_command() -> list[str]:
    return [SHELL, "--x11", "--mode=ubuntu"]


def settings_daemon_commands() -> dict[str, list[str]]:
    return {name: [f"{GSD_DIR}/{name}"] for name in SETTINGS_DAEMONS if os.path.exists(f"{GSD_DIR}/{name}")}


def _workarea(display: str) -> list[int] | None:
    """The root window's ``_NET_WORKAREA`` (x, y, w, h per workspace), None when unset."""
    try:
        r = subprocess.run(["xprop", "-display", display, "-root", "_NET_WORKAREA"], capture_output=True,
                           text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    _, sep, values = r.stdout.partition("=")
    try:
        return [int(v) for v in values.split(",")] if sep else None
    except ValueError:
        return None


def wait_shell_ready(display: str, timeout: float = SHELL_READY_S, stop: Callable[[], bool] = lambda: False) -> bool:
    """Wait until GNOME Shell has laid out its top bar and dock: the work area it publishes
    (``_NET_WORKAREA``) starts right of the dock and below the top bar. Apps started before that
    are placed over the whole screen, not where Ubuntu puts them. False on a timeout."""
    deadline = time.monotonic() + timeout
    while not stop():
        area = _workarea(display)
        if area is not None and len(area) >= 2 and area[0] > 0 and area[1] > 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return False


# What a killed shell leaves on the root window that the next one would take over: its work area
# (wait_shell_ready waits for the new shell's) and its workspaces (mutter starts with as many as
# the root names, so a reset after a task that opened windows would start with two).
STALE_ROOT_PROPERTIES = ("_NET_WORKAREA", "_NET_NUMBER_OF_DESKTOPS", "_NET_DESKTOP_NAMES", "_NET_CURRENT_DESKTOP")


def clear_workarea(display: str) -> None:
    """Remove what a killed shell left on the root window (a warm reset starts another one), so
    that the new shell starts as on a fresh screen (:data:`STALE_ROOT_PROPERTIES`)."""
    removes = [arg for name in STALE_ROOT_PROPERTIES for arg in ("-remove", name)]
    try:
        subprocess.run(["xprop", "-display", display, "-root", *removes], capture_output=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass


def compile_defaults(dest: Path) -> Path:
    """Compile Ubuntu's settings (``assets/gnome/dconf``) into the dconf database file ``dest``
    with ``dconf compile``; returns ``dest``. Raises :class:`GnomeMissing` without dconf."""
    dconf = shutil.which("dconf")
    if dconf is None:
        raise GnomeMissing("dconf (package dconf-cli) is needed to build the GNOME desktop's defaults")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    r = subprocess.run([dconf, "compile", str(tmp), str(GNOME / "dconf")], capture_output=True, text=True)
    if r.returncode != 0:
        raise GnomeMissing(f"dconf compile {GNOME / 'dconf'}: {r.stderr.strip()}")
    os.replace(tmp, dest)
    return dest


def timezone_files(timezone: str) -> dict[str, str]:
    """A GNOME box's time zone as /etc files (relative path -> text; ``->target``: a symlink)."""
    return {"localtime": f"->/usr/share/zoneinfo/{timezone}", "timezone": timezone + "\n"}


def etc_files(db: Path, timezone: str) -> dict[str, bytes | str]:
    """Files a GNOME box's /etc gets (relative path -> content; a ``str`` starting with ``->`` is a
    symlink): the dconf profile and database, the time zone."""
    return {"dconf/profile/user": DCONF_PROFILE, f"dconf/db/{DCONF_DB}": db.read_bytes(), **timezone_files(timezone)}


def install_etc(etc: Path = Path("/etc")) -> None:
    """The desktop image's build step: Ubuntu's settings as the dconf system database and the
    user profile that reads it (containers and VMs share the image's /etc; the time zone is set
    per box, :func:`timezone_files`)."""
    compile_defaults(etc / "dconf" / "db" / DCONF_DB)
    profile = etc / "dconf" / "profile" / "user"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text(DCONF_PROFILE)
