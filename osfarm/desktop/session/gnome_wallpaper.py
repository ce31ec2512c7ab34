"""The GNOME desktop's wallpaper: ``org.gnome.desktop.background picture-uri``, as on OSWorld's VM.

GNOME Shell draws the background itself (a painted X root is hidden under it), and the agent
changes it through the GUI (Files' or Image Viewer's "Set as Wallpaper", Settings > Background)
or ``gsettings``: all of these write the key. So ``/wallpaper`` reads the key and
``/setup/change_wallpaper`` writes it (and its dark-style twin, as Settings does), both through
``gsettings`` run as the agent: the key lives in the agent's dconf database, which a warm reset
restores with the home.
"""

from __future__ import annotations

import ast
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

from osfarm.desktop.box.agent_world import AgentWorld
from osfarm.desktop.box.commands import run_command
from osfarm.errors import OsfarmError

SCHEMA = "org.gnome.desktop.background"
KEYS = ("picture-uri", "picture-uri-dark")
_TIMEOUT_S = 10.0


class WallpaperError(OsfarmError, RuntimeError):
    """gsettings failed (the message says how)."""


def path_from_setting(value: str) -> str | None:
    """The local file a ``gsettings get`` answer names ("'file:///a%20b.png'" -> "/a b.png");
    None for an empty value or one that is not a ``file:`` URI (the agent's, so never trusted)."""
    value = value.strip()
    if not value:
        return None
    try:
        uri = ast.literal_eval(value)  # GVariant's text form of a string is a quoted literal
    except (ValueError, SyntaxError):
        return None
    if not isinstance(uri, str) or not uri:
        return None
    if uri.startswith("/"):
        return uri
    parts = urlsplit(uri)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        return None
    return unquote(parts.path) or None


def file_uri(path: str) -> str:
    """``file://`` URI of an absolute path, percent-encoded as GNOME writes it."""
    return PurePosixPath(path).as_uri()


def _gsettings(agent: AgentWorld | None, home: str, *args: str) -> str:
    r = run_command(["gsettings", *args], False, _TIMEOUT_S, home, agent=agent)
    if r.timed_out or r.returncode != 0:
        why = "timed out" if r.timed_out else r.stderr.strip()[-300:] or f"exit code {r.returncode}"
        raise WallpaperError(f"gsettings {' '.join(args[:2])}: {why}")
    return r.stdout


def current_wallpaper(agent: AgentWorld | None, home: str) -> str | None:
    """The file ``picture-uri`` names now, or None (none set, or not a local file)."""
    return path_from_setting(_gsettings(agent, home, "get", SCHEMA, KEYS[0]))


def set_wallpaper(agent: AgentWorld | None, home: str, path: str) -> None:
    """Point both background keys at ``path`` (the shell redraws on the change)."""
    uri = file_uri(path)
    for key in KEYS:
        _gsettings(agent, home, "set", SCHEMA, key, uri)
